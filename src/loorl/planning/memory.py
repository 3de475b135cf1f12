"""A run's memory plan: each process's peak, term by term, before anything loads (`plan=true`).

DeepSpeed's `estimate_zero3_model_states_mem_needs` and `accelerate estimate-memory` count the model's
states; an RL step also holds a reference, the generation's key/value cache, the output layer's
log-probs and the activations of a micro-batch, and a colocated vLLM. No library counts those, so the
arithmetic is written here, in the terms of docs/performance/7b.md (bytes; Ψ the parameters, N the
FSDP shards, L layers, h hidden, I the MLP width, V the vocabulary, n sequences of T tokens a
micro-batch):

- training state: weights, gradients and AdamW's two moments, (m + m + 2m)Ψ/N for full fine-tuning in
  the master dtype's m bytes (16Ψ/N in float32); LoRA: the frozen base in its own dtype and 16 bytes
  an adapter parameter. Gradients are freed after each optimizer step (Lightning zeroes with
  `set_to_none`), so the generation phase holds the rest.
- autocast's weight casts: under bf16 autocast over float32 trainable weights, torch caches each cast
  for the forward pass, 2Ψ/N (frozen weights are not cached: LoRA's base is cast per use).
- the reference: Ψ/N in `model.ref_dtype` when a KL term needs one, unless offloaded (host) or LoRA
  (the base with the adapters off).
- FSDP's gathered units (N > 1): the root group (embeddings and output layer) gathered in float32 with
  its gradients, 16Vh (8Vh tied), and about two decoder layers gathered, 16 bytes a layer parameter.
- activations of a micro-batch: checkpointed, the layer inputs, L n T h r (r: the residual stream's
  bytes) and one layer recomputed with its gradients, 2 n T (32h + 8I); without checkpointing every
  layer's saved tensors, L n T (16h + 4I); one chunk of c output positions' logits, c V 12
  (`rl.logprob_chunk_tokens`).
- generation: the HF engine's key/value cache, rows x T x L x 2 x kv_heads x head_dim in the compute
  dtype, and a step's logits, rows x V x 6; vLLM in process: its share of the GPU
  (`gpu_memory_utilization`), on CPU its weights in its dtype and `kv_cache_memory_gb`.
- the rest: on CUDA the context and the allocator's slack, 2 GiB; on CPU the process's resident set
  before the model loads (the interpreter, torch, transformers), measured when the plan is made.

Pure functions over two records (`Architecture`, `Workload`); `loorl.planning.inputs` fills them
from the settings. Every term is an estimate: docs/how-to/memory-plan.md compares them with measured
peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GiB = 2**30
CUDA_SLACK = 2 * GiB  # the CUDA context and the caching allocator's fragments (docs/performance/7b.md)


@dataclass(frozen=True)
class Architecture:
    """What the arithmetic needs of a model: its shape and exact parameter counts."""

    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    parameters: int  # all of them, counted on the meta device
    layer_parameters: int  # one decoder layer's
    lora_parameters: int = 0  # the configured adapters' (0: no LoRA)
    largest_parameter: int = 0  # the largest single tensor (the embedding, as a rule)


@dataclass(frozen=True)
class Workload:
    """What a run asks of one process, in bytes and counts (from the resolved settings)."""

    device: str  # cuda | cpu
    device_bytes: int  # the device's memory (CPU: the host's, or the cgroup's limit)
    base_bytes: int  # CPU: the resident set before the model loads; CUDA: context and slack
    master_bytes: int = 4  # the trainable weights' dtype (and AdamW's moments)
    compute_bytes: int = 2  # the compute dtype (autocast's casts, the KV cache, the activations)
    frozen_bytes: int = 4  # LoRA's frozen base weights
    ref_bytes: int = 0  # the reference's dtype; 0: no reference model
    ref_on_device: bool = True  # False: model.ref_offload (in host memory)
    lora: bool = False
    checkpointing: bool = False
    shards: int = 1  # FSDP's N (1: no sharding)
    offload: bool = False  # FSDP's offload_params: the training state in host memory
    sequence_tokens: int = 1  # T: a sequence's tokens at most (prompt and completion)
    microbatch_tokens: int = 1  # n T: a micro-batch's tokens (padded: sequences x T; packed: the cap)
    packed: bool = False  # rl.microbatch_tokens sets the micro-batches (else rl.prompts_per_microbatch)
    samples_per_prompt: int = 1  # K (a padded micro-batch is whole groups)
    chunk_tokens: int = 512  # c: rl.logprob_chunk_tokens
    engine: str = "hf"  # hf | vllm | vllm_server (elsewhere: nothing here)
    generation_rows: int = 1  # sequences the HF engine decodes at once (training rollouts, validation)
    vllm_bytes: int = 0  # vLLM's share in this process (GPU: utilisation x memory; CPU: weights + cache)
    vllm_asleep_in_training: bool = True  # sleep mode frees it while the policy trains


@dataclass(frozen=True)
class Term:
    name: str
    training: float  # bytes held at the training phase's peak
    generating: float  # bytes held at the generation phase's peak
    how: str  # the formula, for the table


@dataclass(frozen=True)
class Plan:
    terms: tuple[Term, ...]
    device: str
    device_bytes: int
    overrides: tuple[str, ...] = field(default=())  # the changes this plan is of (a fix's plan)

    @property
    def training(self) -> float:
        return sum(t.training for t in self.terms)

    @property
    def generating(self) -> float:
        return sum(t.generating for t in self.terms)

    @property
    def peak(self) -> float:
        return max(self.training, self.generating)

    @property
    def fits(self) -> bool:
        return self.peak <= self.device_bytes


def training_state(a: Architecture, w: Workload) -> list[Term]:
    """Weights, gradients and AdamW's moments (full or LoRA), and autocast's cached weight casts."""
    if w.lora:
        base = a.parameters * w.frozen_bytes / w.shards
        adapters = a.lora_parameters * 4
        terms = [
            Term("weights (frozen base)", base, base, f"Ψ x {w.frozen_bytes} / N"),
            Term("adapters, gradients, AdamW", adapters * 4, adapters * 3, "Ψ_lora x 16"),
        ]
    else:
        shard = a.parameters * w.master_bytes / w.shards
        on_device = 0.0 if w.offload else 1.0
        terms = [
            Term("weights", shard * on_device, shard * on_device, f"Ψ x {w.master_bytes} / N"),
            Term("gradients", shard * on_device, 0.0, f"Ψ x {w.master_bytes} / N, freed after the step"),
            Term(
                "AdamW moments", 2 * shard * on_device, 2 * shard * on_device, f"Ψ x {2 * w.master_bytes} / N"
            ),
        ]
    casts = not w.lora and w.compute_bytes < w.master_bytes
    if casts:  # cached for the forward pass (training) and for a whole HF generate call, which
        # generates from the whole policy (gathered under FSDP)
        cast = a.parameters * w.compute_bytes
        generating = cast if w.engine == "hf" else 0.0
        terms.append(Term("autocast weight casts", cast / w.shards, generating, f"Ψ x {w.compute_bytes} / N"))
    return terms


def reference(a: Architecture, w: Workload) -> list[Term]:
    if w.ref_bytes == 0 or w.lora or (not w.ref_on_device and w.device == "cuda"):
        return []
    held = a.parameters * w.ref_bytes / w.shards
    return [Term("reference", held, held, f"Ψ x {w.ref_bytes} / N")]


def fsdp_units(a: Architecture, w: Workload) -> list[Term]:
    if w.shards == 1:
        return []
    root = (8 if a.tied else 16) * a.vocab * a.hidden
    layers = 16 * a.layer_parameters
    # the HF engine generates from the whole policy, gathered in the master dtype for the phase
    generating = a.parameters * w.master_bytes if w.engine == "hf" else 0.0
    return [
        Term(
            "FSDP gathered units",
            root + layers,
            generating,
            "training: 16Vh (8Vh tied) + 16 x layer; HF generation: Ψ x m",
        )
    ]


def activations(a: Architecture, w: Workload) -> list[Term]:
    """One micro-batch's activations at the training phase's peak (nothing of them while generating)."""
    nt = w.microbatch_tokens
    h, i = a.hidden, a.intermediate
    # a layer's saved tensors a token: float32 norms and residual, the attention's inputs and output,
    # the MLP's three I-wide tensors; under bf16 autocast each projection saves its own bf16 cast
    width = 40 * h + (8 if w.compute_bytes == 2 else 16) * i
    width_how = f"(40h + {8 if w.compute_bytes == 2 else 16}I)"
    per_layer = nt * width
    if w.checkpointing:
        residual = 4 if w.master_bytes == 4 and not (w.lora and w.frozen_bytes < 4) else w.compute_bytes
        inputs = a.layers * nt * h * residual
        terms = [
            Term("checkpointed layer inputs", inputs, 0.0, f"L n T h x {residual}"),
            Term("recomputed layer", 2 * per_layer, 0.0, f"2 n T {width_how}"),
        ]
    else:
        terms = [Term("layer activations", a.layers * per_layer, 0.0, f"L n T {width_how}")]
    chunk = min(w.chunk_tokens, nt) * a.vocab * 12
    terms.append(Term("log-prob chunk", chunk, 0.0, "c V x 12"))
    if not w.lora:  # the output layer's weight gradient of a chunk, in the compute dtype and as float32
        head = (
            a.vocab
            * h
            * (w.compute_bytes + w.master_bytes if w.compute_bytes < w.master_bytes else w.master_bytes)
        )
        terms.append(Term("output layer's gradient buffers", head / w.shards, 0.0, "V h x (c + m) / N"))
    return terms


def optimizer_step(a: Architecture, w: Workload, freed: float) -> list[Term]:
    """AdamW's temporaries (its denominator, sqrt(v) / bias correction + eps), beyond the backward's
    transients `freed` by then: on CUDA the foreach path makes it for every tensor at once, Ψ m / N; on
    the CPU the per-tensor path, twice the largest tensor."""
    params = a.lora_parameters * 4 if w.lora else a.parameters * w.master_bytes / w.shards
    largest = 4 * a.lora_parameters if w.lora else a.largest_parameter * w.master_bytes
    temporary = params if w.device == "cuda" else min(params, 2 * largest)
    how = "Ψ m / N" if w.device == "cuda" else "2 x the largest tensor"
    return [Term("AdamW step temporaries (beyond the backward's)", max(0.0, temporary - freed), 0.0, how)]


def generation(a: Architecture, w: Workload) -> list[Term]:
    if w.engine == "hf":
        rows = w.generation_rows
        kv = rows * w.sequence_tokens * a.layers * 2 * a.kv_heads * a.head_dim * w.compute_bytes
        logits = rows * a.vocab * 6
        return [
            Term("HF engine key/value cache", 0.0, kv, f"rows T L 2 kv d x {w.compute_bytes}"),
            Term("HF engine logits", 0.0, logits, "rows V x 6"),
        ]
    if w.engine == "vllm":
        training = 0.0 if (w.vllm_asleep_in_training and w.device == "cuda") else w.vllm_bytes
        how = "utilisation x memory" if w.device == "cuda" else "weights + kv_cache_memory_gb"
        return [Term("vLLM in process", training, w.vllm_bytes, how)]
    return []


def make_plan(a: Architecture, w: Workload, overrides: tuple[str, ...] = ()) -> Plan:
    base = "CUDA context and slack" if w.device == "cuda" else "process before the model (measured)"
    state, transient = training_state(a, w), activations(a, w)
    casts = [t for t in state if t.name == "autocast weight casts"]
    freed = sum(t.training for t in [*transient, *casts])  # gone when the optimizer steps
    terms = [
        *state,
        *reference(a, w),
        *fsdp_units(a, w),
        *transient,
        *optimizer_step(a, w, freed),
        *generation(a, w),
        Term(base, w.base_bytes, w.base_bytes, "fixed"),
    ]
    return Plan(tuple(terms), w.device, w.device_bytes, overrides)


def candidate_fixes(
    a: Architecture, w: Workload, *, devices_on_node: int
) -> list[tuple[tuple[str, ...], Workload]]:
    """The changes that lower the peak, cheapest first (speed and the method kept before memory):
    vLLM's share, activation checkpointing, smaller micro-batches, the reference in host memory, FSDP
    over the node's GPUs, LoRA, and the training state offloaded to the CPU."""
    out: list[tuple[tuple[str, ...], Workload]] = []
    if w.engine == "vllm" and w.device == "cuda":
        for share in (0.3, 0.2):
            if w.vllm_bytes > share * w.device_bytes:
                out.append(
                    (
                        (f"rollout.vllm.gpu_memory_utilization={share}",),
                        replace(w, vllm_bytes=int(share * w.device_bytes)),
                    )
                )
    if not w.checkpointing:
        out.append((("model.gradient_checkpointing=true",), replace(w, checkpointing=True)))
    out.extend(smaller_microbatches(w))
    if w.ref_bytes and w.ref_on_device and not w.lora and w.device == "cuda":
        out.append((("model.ref_offload=true",), replace(w, ref_on_device=False)))
    if w.device == "cuda":
        shards = 2
        while shards <= devices_on_node:
            if shards > w.shards:
                out.append(((f"strategy=fsdp trainer.devices={shards}",), replace(w, shards=shards)))
            shards *= 2
    if not w.lora:
        lora = replace(w, lora=True, frozen_bytes=w.compute_bytes)
        out.append(
            (
                (f"'model.lora={{r: 16, base_dtype: {'bfloat16' if w.compute_bytes == 2 else 'float32'}}}'",),
                lora,
            )
        )
    if w.device == "cuda" and not w.lora and not w.offload:
        out.append((("strategy=fsdp trainer.strategy.offload_params=true",), replace(w, offload=True)))
    return out


def smaller_microbatches(w: Workload) -> list[tuple[tuple[str, ...], Workload]]:
    """Micro-batches halved down to one group (padded) or one longest sequence (packed)."""
    out = []
    if w.packed:
        cap = w.microbatch_tokens
        while cap // 2 >= w.sequence_tokens:
            cap //= 2
            out.append(((f"rl.microbatch_tokens={cap}",), replace(w, microbatch_tokens=cap)))
        return out
    group = w.samples_per_prompt * w.sequence_tokens
    prompts = w.microbatch_tokens // group
    while prompts > 1:
        prompts //= 2
        out.append(((f"rl.prompts_per_microbatch={prompts}",), replace(w, microbatch_tokens=prompts * group)))
    return out


def cheapest_fix(
    a: Architecture, w: Workload, *, devices_on_node: int = 1, lora_parameters: int = 0
) -> Plan | None:
    """The plan of the first single change that fits, else of the changes taken together in order
    until they fit; None when nothing listed fits. `lora_parameters`: the adapters LoRA would add
    (r 16 on the default targets)."""
    fixes = candidate_fixes(a, w, devices_on_node=devices_on_node)
    arch = {True: replace(a, lora_parameters=lora_parameters or a.lora_parameters), False: a}
    for overrides, changed in fixes:
        plan = make_plan(arch[changed.lora], changed, overrides)
        if plan.fits:
            return plan
    taken: tuple[str, ...] = ()
    current = w
    for overrides, changed in fixes:  # together: each change applied on top of the ones before
        merged = _merge(current, w, changed)
        taken += overrides
        current = merged
        plan = make_plan(arch[current.lora], current, taken)
        if plan.fits:
            return plan
    return None


def _merge(current: Workload, original: Workload, changed: Workload) -> Workload:
    """`current` with the fields `changed` altered from `original`."""
    diffs = {k: v for k, v in vars(changed).items() if getattr(original, k) != v}
    if "microbatch_tokens" in diffs:
        diffs["microbatch_tokens"] = min(diffs["microbatch_tokens"], current.microbatch_tokens)
    return replace(current, **diffs)


def table(plan: Plan) -> str:
    """The plan as a markdown table (GiB), its totals and the device's memory."""
    rows = ["| term | training | generating | how |", "| --- | ---: | ---: | --- |"]
    for t in plan.terms:
        rows.append(f"| {t.name} | {t.training / GiB:.2f} | {t.generating / GiB:.2f} | {t.how} |")
    rows.append(f"| **peak** | **{plan.training / GiB:.2f}** | **{plan.generating / GiB:.2f}** | |")
    return "\n".join(rows)


def verdict(plan: Plan, fix: Plan | None) -> str:
    """One line: whether the plan fits the device, and else the change that makes it fit."""
    where = f"{plan.device} ({plan.device_bytes / GiB:.1f} GiB)"
    if plan.fits:
        return f"fits {where}: peak {plan.peak / GiB:.2f} GiB"
    head = f"does not fit {where}: peak {plan.peak / GiB:.2f} GiB"
    if fix is None:
        return head + "; no listed change makes it fit (a larger device, or a smaller model)"
    return f"{head}; {' '.join(fix.overrides)} brings it to {fix.peak / GiB:.2f} GiB"
