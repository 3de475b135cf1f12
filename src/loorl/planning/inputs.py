"""The memory plan's inputs from a run's settings: the model's `Architecture` (from its config alone, on
the meta device: no weights, no download) and the `Workload` one process carries
(`loorl.planning.memory` has the arithmetic)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from loorl.models.lora import matches
from loorl.planning.memory import CUDA_SLACK, Architecture, GiB, Workload
from loorl.settings.model import LORA_DEFAULT_TARGETS

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FIX_LORA_RANK = 16  # the rank a LoRA fix proposes (the `model.lora` default)


def lora_parameter_count(tree: torch.nn.Module, rank: int, targets) -> int:
    """Adapter parameters r (in + out) over the linear layers `targets` name (peft's matching rule)."""
    return sum(
        rank * (module.in_features + module.out_features)
        for name, module in tree.named_modules()
        if isinstance(module, torch.nn.Linear) and any(matches(name, t) for t in targets)
    )


def architecture_of(config, lora=None) -> tuple[Architecture, int]:
    """(the architecture, with `lora`'s adapters counted; the adapters a LoRA fix of rank 16 on the
    default targets would add). Counted on the meta device: exact, and no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        tree = AutoModelForCausalLM.from_config(config)
    layer = tree.model.layers[0]
    heads = config.num_attention_heads
    arch = Architecture(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        parameters=sum(p.numel() for p in tree.parameters()),
        layer_parameters=sum(p.numel() for p in layer.parameters()),
        largest_parameter=max(p.numel() for p in tree.parameters()),
        lora_parameters=0 if lora is None else lora_parameter_count(tree, lora.r, lora.target_modules),
    )
    return arch, lora_parameter_count(tree, FIX_LORA_RANK, LORA_DEFAULT_TARGETS)


def host_memory_bytes() -> int:
    """The host's memory, or the cgroup's limit when lower (a container, a SLURM job)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def resident_bytes() -> int:
    """This process's resident set now (what the CPU plan starts from)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cuda_memory_bytes() -> int:
    index = (
        torch.cuda.current_device() if torch.cuda.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    )
    return torch.cuda.get_device_properties(index).total_memory


def longest_prompt(task, tokenizer, *, prompts_per_step: int, seed: int) -> int:
    """The longest prompt in tokens of the first step's and the held-out prompts (what a padded batch
    is as long as), as the engine encodes them."""
    prompts = [*task.prompts_for_step(0, prompts_per_step, seed=seed), *task.eval_prompts()]
    return max(len(tokenizer(p.text, add_special_tokens=False).input_ids) for p in prompts)


def parse_plan_device(text: str) -> tuple[bool, int, int]:
    """`plan_device` (cuda:80, cuda:141x8, cpu:64): (CUDA?, a device's bytes, devices on the node)."""
    kind, _, size = text.partition(":")
    gib, _, count = size.partition("x")
    return kind == "cuda", int(float(gib) * GiB), int(count or 1)


def workload_of(
    s,
    *,
    world: int = 1,
    processes_on_host: int = 1,
    offload: bool = False,
    on_cuda: bool | None = None,
    device_bytes: int | None = None,
    prompt_tokens: int | None = None,
) -> Workload:
    """One process's `Workload` from a run's checked settings `s` (`loorl.config.Settings`; duck-typed:
    this layer does not import it). `world`: the run's processes (FSDP shards over them; each gets
    its share of a step's prompts); `processes_on_host`: those on this machine, which share its memory
    (CPU); `offload`: FSDP's offload_params; `on_cuda`, `device_bytes`: another device than this
    machine's (`plan_device`); `prompt_tokens`: the longest prompt (None: `rollout.max_prompt_length`,
    the most a prompt may have)."""
    on_cuda = s.on_cuda if on_cuda is None else on_cuda
    model, rl, rollout = s.model, s.rl, s.rollout
    prompt = (
        rollout.max_prompt_length if prompt_tokens is None else min(prompt_tokens, rollout.max_prompt_length)
    )
    sequence_tokens = prompt + s.completion_tokens
    k = rl.samples_per_prompt
    packed = rl.microbatch_tokens is not None
    microbatch = rl.microbatch_tokens if packed else rl.prompts_per_microbatch * k * sequence_tokens
    engine = rollout.engine if rollout.engine != "auto" else ("vllm" if on_cuda else "hf")
    compute = DTYPE_BYTES[model.dtype]
    per_step = max(1, rl.prompts_per_step * k // world)
    validation = rollout.eval_batch_size * max(1, s.run.val_pass_k)
    rows = min(rollout.batch_size, max(per_step, validation))
    if on_cuda:
        device_bytes, base = device_bytes or cuda_memory_bytes(), CUDA_SLACK
    else:
        device_bytes, base = (device_bytes or host_memory_bytes()) // processes_on_host, resident_bytes()
    return Workload(
        device="cuda" if on_cuda else "cpu",
        device_bytes=device_bytes,
        base_bytes=base,
        master_bytes=DTYPE_BYTES[model.master_dtype],
        compute_bytes=compute,
        frozen_bytes=DTYPE_BYTES[model.lora.base_dtype]
        if model.lora is not None
        else DTYPE_BYTES[model.master_dtype],
        ref_bytes=DTYPE_BYTES[model.ref_dtype] if s.kl.needs_reference else 0,
        ref_on_device=not model.ref_offload,
        lora=model.lora is not None,
        checkpointing=model.gradient_checkpointing,
        shards=world if s.strategy == "fsdp" else 1,
        offload=offload,
        sequence_tokens=sequence_tokens,
        microbatch_tokens=microbatch,
        packed=packed,
        samples_per_prompt=k,
        chunk_tokens=rl.logprob_chunk_tokens,
        engine=engine,
        generation_rows=rows,
        vllm_bytes=0,  # set by `with_vllm` once the parameters are counted
        vllm_asleep_in_training=bool((rollout.vllm or {}).get("sleep_level")),
    )


def with_vllm(w: Workload, arch: Architecture, vllm: dict | None, model_dtype: str) -> Workload:
    """vLLM's share in this process: on CUDA `gpu_memory_utilization` of the GPU; on the CPU its weights
    in its dtype and `kv_cache_memory_gb` (1 GiB by default there)."""
    from dataclasses import replace

    if w.engine != "vllm":
        return w
    vllm = vllm or {}
    if w.device == "cuda":
        share = int(float(vllm.get("gpu_memory_utilization") or 0.5) * w.device_bytes)
    else:
        dtype = vllm.get("dtype") or model_dtype
        share = arch.parameters * DTYPE_BYTES[dtype] + int(float(vllm.get("kv_cache_memory_gb") or 1.0) * GiB)
    return replace(w, vllm_bytes=share)
