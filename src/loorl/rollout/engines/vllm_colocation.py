"""Where a colocated vLLM engine (`rollout=vllm`) sits, and what its `LLM` is built with.

In one process, and on CPU, vLLM's in-process executor. Under DDP/FSDP on CUDA each rank builds its
own engine on its own GPU (`Colocation`), under vLLM's external launcher (`llm_arguments`,
`launcher_environment`), with a seed of its own (`rank_seed`). The CUDA case is untested on GPU.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from loorl.parallel.distributed import rank_and_world
from loorl.util.hardware import cuda_available
from loorl.util.units import gib_to_bytes


@dataclass(frozen=True)
class Colocation:
    """Where this rank's engine sits under DDP/FSDP on CUDA: rank `rank` of `world`, on the trainer's
    own CUDA device `device` (an index as `torch.cuda.current_device()` gives it)."""

    rank: int
    world: int
    device: int


def colocation() -> Colocation | None:
    """This process's placement, read when the engine is built (at the first sync, when the trainer's
    process group exists). None in one process and without CUDA: vLLM's in-process executor, as on CPU,
    where each of several ranks' engines runs on the CPU anyway. The CUDA case is untested on GPU."""
    rank, world = rank_and_world()
    if world == 1 or not cuda_available():
        return None
    import torch

    return Colocation(rank=rank, world=world, device=torch.cuda.current_device())


def rank_seed(seed: int, rank: int) -> int:
    """The engine seed of rank `rank`: a pure function of the run's seed and the rank, so each rank's
    engine seeds its own random state (TRL's colocate mode passes a seed per rank too)."""
    return int(np.random.default_rng([seed, rank]).integers(2**31 - 1))


def llm_arguments(
    *,
    model_path: str,
    dtype: str,
    seed: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    kv_cache_memory_gib: float | None,
    tensor_parallel_size: int,
    enforce_eager: bool,
    sleep_level: int | None,
    chunked_prefill: bool,
    colocation: Colocation | None = None,
) -> dict:
    """The keyword arguments of vLLM's `LLM` for this process.

    With `colocation` (N ranks on CUDA) the engine runs under vLLM's external launcher
    (`distributed_executor_backend="external_launcher"`, as TRL's colocate mode): vLLM then places its
    worker on the device `launcher_environment` names in LOCAL_RANK instead of GPU 0, and reuses the
    trainer's process group (its own groups are built over it, every rank building at the same sync);
    each rank gets its own seed. Untested on GPU. Without it, the in-process executor's arguments."""
    args = {
        "model": model_path,
        "dtype": dtype,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",  # the distribution it sampled from
        "generation_config": "vllm",  # no sampling defaults from the model's generation_config.json
        "enable_sleep_mode": sleep_level is not None,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "tensor_parallel_size": tensor_parallel_size,
        "enforce_eager": enforce_eager,
    }
    if kv_cache_memory_gib is not None:
        args["kv_cache_memory_bytes"] = gib_to_bytes(kv_cache_memory_gib)
    if not chunked_prefill:  # whole prompts per step: the budget must hold the longest one
        args |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}
    if colocation is not None:
        args |= {
            "distributed_executor_backend": "external_launcher",
            "seed": rank_seed(seed, colocation.rank),
        }
    return args


def launcher_environment(colocation: Colocation | None) -> dict[str, str]:
    """The variables vLLM's external launcher reads while `LLM` is built: RANK and LOCAL_RANK (the
    worker's device index: the trainer's own device, also under `trainer.devices=[2,3]`), and
    WORLD_SIZE as torchrun sets it. MASTER_ADDR/MASTER_PORT are not needed: vLLM reads them only to
    create a process group when none exists, and the trainer's exists. {} without colocation."""
    if colocation is None:
        return {}
    return {
        "RANK": str(colocation.rank),
        "LOCAL_RANK": str(colocation.device),
        "WORLD_SIZE": str(colocation.world),
    }


@contextmanager
def scoped_environment(variables: dict[str, str]):
    """`variables` set in os.environ for the block only: Lightning reads LOCAL_RANK as the trainer's
    local rank, which the device index need not equal."""
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
