"""Data parallelism over whole prompt groups: what a rank owns, and the cross-rank reductions.

Each of the W ranks (processes) owns a contiguous block of B/W whole prompt groups of every RL step:
it generates, grades and trains on them. Whatever needs the whole step (advantages whitened over
the batch, loss normalisers, logged statistics) is gathered or reduced with torch.distributed,
which Lightning's strategy has initialised (gloo on CPU, NCCL on GPU). In one process every
function here is the identity, so single-process runs take no distributed code path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loorl.errors import ConfigError


def is_distributed() -> bool:
    """More than one rank. (vLLM initialises a one-rank process group of its own: not distributed.)"""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Every rank waits until all have reached it; nothing in one process."""
    if is_distributed():
        dist.barrier()


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def rank_block(n: int, rank: int, world: int) -> range:
    """The indices rank `rank` of `world` owns of n items: a contiguous block of n / world. Blocks of
    consecutive ranks follow each other, so together they cover 0..n-1 once, in order."""
    if n % world:
        raise ValueError(f"{n} items do not split evenly over {world} ranks")
    size = n // world
    return range(rank * size, (rank + 1) * size)


def _device(t: torch.Tensor) -> torch.device:
    """The device a collective needs its tensors on: NCCL wants CUDA, gloo CPU (or CUDA)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] in one process. A collective."""
    if not is_distributed():
        return [obj]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, ...] of every rank (equal n), concatenated in rank order: [W * n, ...]."""
    if not is_distributed():
        return x
    local = x.detach().contiguous().to(_device(x))
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return torch.cat(out).to(x.device)


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce(values: torch.Tensor | float, op: str = "sum") -> torch.Tensor:
    """The sum (max, min) over ranks of a tensor or number; a float64 CPU tensor."""
    x = torch.as_tensor(values, dtype=torch.float64)
    if not is_distributed():
        return x
    y = x.to(_device(x))
    dist.all_reduce(y, op=getattr(dist.ReduceOp, _OPS[op]))
    return y.cpu()


def check_world_divides(prompts_per_step: int, prompts_per_minibatch: int, world: int, where: str) -> None:
    """Every rank must get whole groups: B/W per step and M/W per mini-batch (a ConfigError naming the
    settings and the fix; `where` says how W was set)."""
    for key, n in (
        ("rl.prompts_per_step", prompts_per_step),
        ("rl.prompts_per_minibatch", prompts_per_minibatch),
    ):
        if n % world:
            raise ConfigError(
                f"{key}={n} does not split into whole prompt groups over {world} processes ({where}): "
                f"set {key} to a multiple of {world}"
            )


def shutdown() -> None:
    """End a multi-process run's process group in order: every rank waits for the others, then
    destroys it. Left to interpreter exit, gloo's threads were seen to abort a rank after a run that
    had succeeded ("terminate called without an active exception", exit -6), under CPU contention."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def lost_peer(err: BaseException) -> str | None:
    """The first line of a collective that failed because another process of the run is gone or hung
    (a closed connection, gloo's or NCCL's timeout: `trainer.strategy.timeout`), found anywhere in
    `err`'s chain; None for any other error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and "/gloo/" in text):
            line = text.strip().splitlines()[0] if text.strip() else type(err).__name__
            line = line.split("] ", 1)[-1]  # gloo's "[<source file>:<line>] " prefix off
            return line.split(". ", 1)[0][:200]  # its first sentence (gloo adds advice that does not apply)
        err = err.__cause__ or err.__context__
    return None
