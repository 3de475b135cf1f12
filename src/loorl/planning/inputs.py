"""The memory plan's inputs from a run's settings: the model's `Architecture` (from its config alone, on
the meta device: no weights, no download) and the `Workload` one process carries
(`loorl.planning.memory` has the arithmetic)."""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
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
    """This process's resident set now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):  # glibc's `struct mallinfo2` (malloc.h, glibc 2.33+)
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]  # fmt: skip


def free_heap_bytes() -> int:
    """The bytes glibc's heaps hold free (`mallinfo2`: fordblks, all arenas); 0 where the C library is not
    glibc 2.33 or newer. Under `keep_freed_memory` they stay resident, and the run's next allocations
    are carved from them first."""
    try:
        mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def process_before_the_model(resident: int, free_in_heap: int) -> int:
    """What the CPU plan starts from: the resident set less the heap's free bytes. A model built and
    dropped before the plan (a tokenizer's GGUF model converted on a fresh cache, qwen05b's random
    weights) leaves its memory resident and free, kept for the run's own tensors, which reuse it; counted
    here it would be counted twice (the issue's 1.72 GiB on a fresh cache against 0.66 on a warm one)."""
    return max(0, resident - free_in_heap)


def cuda_memory_bytes() -> int:
    index = (
        torch.cuda.current_device() if torch.cuda.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    )
    return torch.cuda.get_device_properties(index).total_memory


def longest_prompt(task, tokenizer, *, prompts_per_step: int, seed: int, max_prompt_length: int) -> int:
    """The longest prompt in tokens of the first step's and the held-out prompts (what a padded batch
    is as long as), as the engine encodes them: rendered with the policy's chat template, which a task
    applies once it is prepared (`Task.prepare`; a copy is prepared here, the run's own task later). A
    chat template is most of a short prompt: SmolLM2's system turn makes a 16-token arithmetic question
    46 tokens."""
    rendered = copy.copy(task)
    rendered.prepare(tokenizer, max_prompt_length=max_prompt_length)
    prompts = [*rendered.prompts_for_step(0, prompts_per_step, seed=seed), *rendered.eval_prompts()]
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
    minibatch = max(1, rl.prompts_per_minibatch // world) * k * sequence_tokens  # a rank's, at most
    passes = -(-minibatch // microbatch)  # forward-backward passes an optimizer step accumulates
    engine = rollout.engine if rollout.engine != "auto" else ("vllm" if on_cuda else "hf")
    compute = DTYPE_BYTES[model.dtype]
    per_step = max(1, rl.prompts_per_step * k // world)
    validation = rollout.eval_batch_size * max(1, s.run.val_pass_k)
    rows = min(rollout.batch_size, max(per_step, validation))
    sampled = min(rollout.batch_size, max(per_step, validation if s.run.val_pass_k else 0))
    if on_cuda:
        device_bytes, base = device_bytes or cuda_memory_bytes(), CUDA_SLACK
    else:
        device_bytes = (device_bytes or host_memory_bytes()) // processes_on_host
        base = process_before_the_model(resident_bytes(), free_heap_bytes())
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
        microbatches_per_step=passes,
        samples_per_prompt=k,
        chunk_tokens=rl.logprob_chunk_tokens,
        engine=engine,
        generation_rows=rows,
        sampled_rows=sampled,
        cache_tokens=hf_cache_tokens(sequence_tokens, rollout.hf_decode),
        vllm_bytes=0,  # set by `with_vllm` once the parameters are counted
        vllm_asleep_in_training=bool((rollout.vllm or {}).get("sleep_level")),
        keeps_freed_memory=not on_cuda and s.run.keep_freed_memory in (True, "auto"),
    )


CACHE_BUCKET = 64  # loorl.rollout.engines.decoding's: the HF engine's cache length is a multiple of it


def hf_cache_tokens(sequence_tokens: int, hf_decode: str) -> int:
    """The positions the HF engine's key/value cache holds a row: prompt and completion, rounded up to
    `CACHE_BUCKET` (a dynamic cache's buffers, where rows that end leave them, and a compiled step's
    static cache; `auto` is one of them), exact for `rollout.hf_decode=static`."""
    if hf_decode == "static":
        return sequence_tokens
    return -(-sequence_tokens // CACHE_BUCKET) * CACHE_BUCKET


def with_vllm(w: Workload, arch: Architecture, vllm: dict | None, model_dtype: str) -> Workload:
    """vLLM's share in this process: on CUDA `gpu_memory_utilization` of the GPU; on the CPU its weights
    in its dtype and `kv_cache_memory_gib` (1 GiB by default there)."""
    from dataclasses import replace

    if w.engine != "vllm":
        return w
    vllm = vllm or {}
    if w.device == "cuda":
        share = int(float(vllm.get("gpu_memory_utilization") or 0.5) * w.device_bytes)
    else:
        dtype = vllm.get("dtype") or model_dtype
        kv_cache = int(float(vllm.get("kv_cache_memory_gib") or 1.0) * GiB)
        share = arch.parameters * DTYPE_BYTES[dtype] + kv_cache
    return replace(w, vllm_bytes=share)
