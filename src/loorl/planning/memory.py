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
  for the forward pass, 2Ψ/N (frozen weights are not cached: LoRA's float32 base is cast at each use,
  its largest tensor, the output layer, held at once: in training, kept for the log-prob backward, and
  at every decoding step).
- the reference: Ψ/N in `model.ref_dtype` when a KL term needs one, unless offloaded (host) or LoRA
  (the base with the adapters off).
- FSDP's gathered units (N > 1): the root group (embeddings and output layer) gathered in float32 with
  its gradients, 16Vh (8Vh tied), and about two decoder layers gathered, 16 bytes a layer parameter.
- activations of a micro-batch: checkpointed, the layer inputs, L n T h r (r: the residual stream's
  bytes) and one layer recomputed with its gradients, 2 n T (32h + 8I); without checkpointing every
  layer's saved tensors, L n T (16h + 4I); one chunk of c output positions' logits, c V 12
  (`rl.logprob_chunk_tokens`); on the CPU the output layer's weight transposed for the matmul, V h c.
- generation: the HF engine's key/value cache, rows x T' x L x 2 x kv_heads x head_dim in the compute
  dtype (T' the sequence rounded up to 64 positions, the buffers' length), and a sampled step's
  logits, float32 scaled logits, log-probs, probabilities and float64 CDF (with the float64 copy
  `cumsum` makes of its input), rows x V x (c + 28); vLLM in process: its share of the GPU
  (`gpu_memory_utilization`), on CPU its weights in its dtype and `kv_cache_memory_gib`.
- the rest: on CUDA the context and the allocator's slack, 2 GiB; on CPU the process's resident set
  before the model loads (the interpreter, torch, transformers) less what glibc's heap holds free,
  measured when the plan is made.

The peak is the larger phase's, except on the CPU under `keep_freed_memory` where the sampling step's
float64 buffers outgrow training's largest freed one: the heap cannot reuse training's memory for them,
and they sit on top of it (`phases_add`).

Pure functions over two records (`Architecture`, `Workload`); `loorl.planning.inputs` fills them
from the settings. Every term is an estimate: docs/how-to/memory-plan.md compares them with measured
peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loorl.util.units import GiB

# the terms gradients_replace_activations weighs against each other, by their names in the table
GRADIENTS = "gradients"
LAYER_ACTIVATIONS = "layer activations"
CHECKPOINTED_INPUTS = "checkpointed layer inputs"
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
    microbatches_per_step: int = 2  # forward-backward passes an optimizer step accumulates (2: several)
    samples_per_prompt: int = 1  # K (a padded micro-batch is whole groups)
    chunk_tokens: int = 512  # c: rl.logprob_chunk_tokens
    engine: str = "hf"  # hf | vllm | vllm_server (elsewhere: nothing here)
    generation_rows: int = 1  # sequences the HF engine decodes at once (training rollouts, validation)
    sampled_rows: int = 0  # of them, those sampled (rollouts, pass@k), not greedy; they hold the sampler's
    cache_tokens: int = 0  # the HF engine's key/value positions a row (rounded up to a bucket); 0: T
    vllm_bytes: int = 0  # vLLM's share in this process (GPU: utilisation x memory; CPU: weights + cache)
    vllm_asleep_in_training: bool = True  # sleep mode frees it while the policy trains
    keeps_freed_memory: bool = False  # CPU `run.keep_freed_memory`: what a phase frees stays resident


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
    sampling_on_training: bool = False  # the sampling step held on top of training's peak (`phases_add`)

    @property
    def training(self) -> float:
        return sum(t.training for t in self.terms)

    @property
    def generating(self) -> float:
        return sum(t.generating for t in self.terms)

    @property
    def peak(self) -> float:
        """The larger phase's total; where the sampling step's buffers do not fit in what training freed
        (`phases_add`), training's total with the sampling step on top, if larger."""
        if self.sampling_on_training:
            sampling = sum(t.generating for t in self.terms if t.name == "HF engine sampling step")
            return max(self.training + sampling, self.generating)
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
            Term(GRADIENTS, shard * on_device, 0.0, f"Ψ x {w.master_bytes} / N, freed after the step"),
            Term(
                "AdamW moments", 2 * shard * on_device, 2 * shard * on_device, f"Ψ x {2 * w.master_bytes} / N"
            ),
        ]
    if w.lora and w.compute_bytes < w.frozen_bytes:  # autocast does not cache a frozen weight's cast: each
        # use casts it anew. In training every linear saves its cast for the backward (the gradient of
        # its input), so a forward holds the whole base's casts (measured: a layer's bf16 weights a pass,
        # SmolLM2, issue 79); a decoding step (no autograd) holds the largest, the output layer's
        cast = a.largest_parameter * w.compute_bytes
        terms.append(
            Term(
                "autocast's per-use cast (frozen base)",
                a.parameters * w.compute_bytes / w.shards,
                cast if w.engine == "hf" else 0.0,
                f"training: Ψ x {w.compute_bytes}; decoding: the largest tensor x {w.compute_bytes}",
            )  # fmt: skip
        )
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


def residual_bytes(w: Workload) -> int:
    """The residual stream's bytes an element: float32 over float32 weights (autocast casts at each
    projection), the compute dtype over a low-precision LoRA base or without autocast."""
    return 4 if w.master_bytes == 4 and not (w.lora and w.frozen_bytes < 4) else w.compute_bytes


def layer_width(a: Architecture, w: Workload) -> tuple[int, str]:
    """The bytes one decoder layer saves for its backward a token (`a.kv_heads` x `a.head_dim` = kv),
    from the tensors autograd saves in a Llama layer (SmolLM2, counted with `saved_tensors_hooks`, issue
    79): each RMSNorm its float32 input and normalised output (8h, twice); the attention's q, k, v
    after the rotary embedding, its output and o_proj's input; the MLP's gate, up, their product and
    the activation (four I-wide tensors).
    - bf16 autocast over a float32 residual: the norms 16h, the projections' bf16 casts of their
      inputs (q, k, v, gate, up: 10h), q 2h and k, v 4kv, attention out and o_proj's input 4h, the MLP 8I:
      32h + 4kv + 8I (measured 31.5 kB a token against 31.5 computed, h 576, kv 192, I 1536);
    - float32: no casts, 4-byte tensors: 28h + 8kv + 16I (measured 44.7 kB, computed 42.2);
    - LoRA over a bf16 base: a bf16 residual, the adapters' inputs and rank-wide outputs beside the
      base's: 26h + 4kv + 8I (measured 27.8 kB, computed 28.0)."""
    h, kv, i = a.hidden, a.kv_heads * a.head_dim, a.intermediate
    if w.compute_bytes == 4:
        return 28 * h + 8 * kv + 16 * i, "(28h + 8kv + 16I)"
    if residual_bytes(w) == 4:
        return 32 * h + 4 * kv + 8 * i, "(32h + 4kv + 8I)"
    return 26 * h + 4 * kv + 8 * i, "(26h + 4kv + 8I)"


def activations(a: Architecture, w: Workload) -> list[Term]:
    """One micro-batch's activations at the training phase's peak (nothing of them while generating)."""
    nt = w.microbatch_tokens
    width, width_how = layer_width(a, w)
    h = a.hidden
    per_layer = nt * width
    if w.checkpointing:
        residual = residual_bytes(w)
        inputs = a.layers * nt * h * residual
        terms = [
            Term(CHECKPOINTED_INPUTS, inputs, 0.0, f"L n T h x {residual}"),
            Term("recomputed layer", 2 * per_layer, 0.0, f"2 n T {width_how}"),
        ]
    else:
        terms = [Term(LAYER_ACTIVATIONS, a.layers * per_layer, 0.0, f"L n T {width_how}")]
    chunk = min(w.chunk_tokens, nt) * a.vocab * 12
    terms.append(Term("log-prob chunk", chunk, 0.0, "c V x 12"))
    if w.device == "cpu":  # the CPU matmul wants the output layer's weight untransposed: a copy a pass
        terms.append(Term("output layer's transposed copy", a.vocab * h * w.compute_bytes, 0.0, "V h x c"))
    if not w.lora:
        if w.device == "cpu":  # the weight's gradient summed as float32 [h, V], then copied to [V, h]
            head, head_how = a.vocab * h * 2 * w.master_bytes, "V h x 2m / N"
        else:  # a chunk's weight gradient in the compute dtype and the float32 sum
            c_m = w.compute_bytes + w.master_bytes if w.compute_bytes < w.master_bytes else w.master_bytes
            head, head_how = a.vocab * h * c_m, "V h x (c + m) / N"
        terms.append(Term("output layer's gradient buffers", head / w.shards, 0.0, head_how))
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
        rows, c = w.generation_rows, w.compute_bytes
        positions = w.cache_tokens or w.sequence_tokens
        kv = rows * positions * a.layers * 2 * a.kv_heads * a.head_dim * c
        # a sampled step holds its logits (compute dtype), the float32 scaled logits and log-probs, and
        # in `sample_tokens` the probabilities (float32) and their CDF, for which `cumsum(dtype=float64)`
        # makes a float64 copy of its input: c + 4 + 4 + 4 + 8 + 8 bytes an entry (measured: 20 bytes
        # an entry in `sample_tokens`); a greedy step holds its logits only
        step = a.vocab * max(w.sampled_rows * (c + 28), rows * c)
        return [
            Term("HF engine key/value cache", 0.0, kv, f"rows T' L 2 kv d x {c} (T' rounded up to 64)"),
            Term("HF engine sampling step", 0.0, step, f"sampled rows V x ({c} + 28); greedy rows V x {c}"),
        ]
    if w.engine == "vllm":
        training = 0.0 if (w.vllm_asleep_in_training and w.device == "cuda") else w.vllm_bytes
        how = "utilisation x memory" if w.device == "cuda" else "weights + kv_cache_memory_gib"
        return [Term("vLLM in process", training, w.vllm_bytes, how)]
    return []


def make_plan(a: Architecture, w: Workload, overrides: tuple[str, ...] = ()) -> Plan:
    base = "CUDA context and slack" if w.device == "cuda" else "process before the model (measured)"
    state, transient = training_state(a, w), activations(a, w)
    if w.microbatches_per_step == 1:  # the backward frees a layer's activations as its gradients appear
        state = gradients_replace_activations(state, transient)
    casts = [t for t in state if t.name in ("autocast weight casts", "autocast's per-use cast (frozen base)")]
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
    return Plan(tuple(terms), w.device, w.device_bytes, overrides, sampling_on_training=phases_add(a, w))


def gradients_replace_activations(state: list[Term], transient: list[Term]) -> list[Term]:
    """With one micro-batch an optimizer step, no gradient exists when the backward starts (the last
    step's were freed) and it frees each layer's activations as that layer's gradients appear: the
    gradients count only where they outgrow the layers' activations (with several micro-batches the
    first one's gradients are held through the next one's forward, and both count)."""
    layers = sum(t.training for t in transient if t.name in (LAYER_ACTIVATIONS, CHECKPOINTED_INPUTS))
    return [
        Term(t.name, max(0.0, t.training - layers), t.generating, f"{t.how}; beyond the activations it frees")
        if t.name == GRADIENTS
        else t
        for t in state
    ]


def phases_add(a: Architecture, w: Workload) -> bool:
    """Whether the sampling step adds to training's peak instead of taking turns with it: on the CPU
    under `keep_freed_memory` the heap keeps what training freed, and the HF engine's sampling buffers
    (the float64 CDF of the sampled rows, rows x V x 8) reuse it only where they fit in training's
    largest freed buffer (a log-prob chunk's float32 logits, or the output layer's copy); the key/value
    cache's per-layer buffers fit. qwen05b, LoRA over a float32 base, 512 rows (622 MB buffers against
    311): generation rose 2.96 GB above what training had left resident; 32 rows (39 MB): the run's
    peak was training's."""
    if not w.keeps_freed_memory or w.engine != "hf":
        return False
    sampling = w.sampled_rows * a.vocab * 8
    training = max(
        min(w.chunk_tokens, w.microbatch_tokens) * a.vocab * 4, a.vocab * a.hidden * w.compute_bytes
    )
    return sampling > training


def table(plan: Plan) -> str:
    """The plan as a markdown table (GiB), its totals and the device's memory."""
    rows = ["| term | training | generating | how |", "| --- | ---: | ---: | --- |"]
    for t in plan.terms:
        rows.append(f"| {t.name} | {t.training / GiB:.2f} | {t.generating / GiB:.2f} | {t.how} |")
    rows.append(f"| **peak** | **{plan.training / GiB:.2f}** | **{plan.generating / GiB:.2f}** | |")
    if plan.sampling_on_training:
        rows.append(
            f"| **peak, freed memory kept** | **{plan.peak / GiB:.2f}** | | training + sampling step |"
        )
    return "\n".join(rows)
