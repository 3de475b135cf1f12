"""What the processes of a multi-process run must agree on, checked as soon as they can talk to each
other (the process group exists, no checkpoint is loaded yet), once per process:

- **Resume.** Every rank resumes from the same step, or all start fresh. With a run folder per node
  (not shared), `resume_from=auto` would find `last.ckpt` on node 0 only: node 0 would resume while
  node 1 started over, a silently different run. That is one ConfigError line on every rank instead.
- **Sharded checkpoints need one folder.** FSDP's distributed checkpoint is one folder that every rank
  writes its shards into; with a run folder per node the shards would end up split across nodes.
- **Threads fit the cores.** Processes on one host whose CPU sets overlap (two torchrun "nodes" started
  on one machine without pinning, say) share those cores: their threads are cut to fit, with a
  warning. Placement read from the environment (`loorl.parallel.launch`) cannot see the other nodes.

Whether the run folder is shared is seen, not configured: rank 0 writes a marker file into it and the
other ranks look for it.
"""

from __future__ import annotations

import logging
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from loorl.errors import ConfigError
from loorl.parallel.launch import cpu_set

log = logging.getLogger("loorl")


@dataclass(frozen=True)
class RankFacts:
    rank: int
    host: str
    cpus: tuple[int, ...]  # the CPUs this process may run on
    threads: int  # its intra-op threads
    resume_step: int | None  # the RL step its checkpoint holds, None when it starts fresh
    sees_rank0_folder: bool  # rank 0's marker file is visible in this rank's output_dir


def agreement_problem(facts: list[RankFacts], *, sharded_checkpoints: bool) -> str | None:
    """The first thing the ranks disagree on that the run cannot go on with, as one line; else None."""
    resumes = {f.resume_step for f in facts}
    shared = all(f.sees_rank0_folder for f in facts)
    where = "" if shared else " (output_dir is not one shared folder: each node has its own)"
    if len(resumes) > 1:
        said = ", ".join(
            f"rank {f.rank} starts fresh"
            if f.resume_step is None
            else f"rank {f.rank} resumes after step {f.resume_step}"
            for f in facts
        )
        return (
            f"the processes do not resume from the same checkpoint ({said}){where}: put output_dir on a "
            "folder every node shares, or give every node the same resume_from checkpoint"
        )
    if sharded_checkpoints and not shared:
        return (
            "strategy=fsdp writes one checkpoint folder that every rank adds its shards to, but output_dir "
            "is not shared between the nodes: put output_dir on a shared filesystem, or set "
            "trainer.strategy.save_distributed_checkpoint=false (rank 0 gathers one file)"
        )
    return None


def fitted_threads(facts: list[RankFacts], rank: int) -> int | None:
    """A lower thread count for `rank` when it shares CPUs with other processes on its host and their
    threads together outnumber those CPUs (the union of the sharing processes' sets, split evenly);
    None when its threads already fit."""
    me = next(f for f in facts if f.rank == rank)
    sharing = [f for f in facts if f.host == me.host and set(f.cpus) & set(me.cpus)]
    cpus = set().union(*(f.cpus for f in sharing))
    if sum(f.threads for f in sharing) <= len(cpus):
        return None
    fit = max(1, len(cpus) // len(sharing))
    return fit if fit < me.threads else None


def _rank0_marker(strategy, output_dir: Path) -> Path:
    """A fresh marker in rank 0's output_dir, its name broadcast to every rank."""
    name = f".loorl-shared-{uuid.uuid4().hex}" if strategy.global_rank == 0 else None
    name = strategy.broadcast(name)
    marker = output_dir / name
    if strategy.global_rank == 0:
        marker.touch()
    strategy.barrier()
    return marker


class RankChecks(L.Callback):
    """Runs `agreement_problem` and `fitted_threads` over every rank's `RankFacts` at the first `setup`
    of a multi-process run."""

    def __init__(self, output_dir: Path, *, resume_step: int | None) -> None:
        self.output_dir = Path(output_dir)
        self.resume_step = resume_step
        self.done = False

    def setup(self, trainer, pl_module, stage) -> None:
        if self.done or trainer.world_size < 2 or not dist.is_initialized():
            return
        self.done = True
        strategy = trainer.strategy
        marker = _rank0_marker(strategy, self.output_dir)
        mine = RankFacts(
            rank=strategy.global_rank,
            host=socket.gethostname(),
            cpus=cpu_set(),
            threads=torch.get_num_threads(),
            resume_step=self.resume_step,
            sees_rank0_folder=marker.exists(),
        )
        facts: list[RankFacts] = [None] * trainer.world_size  # type: ignore[list-item]
        dist.all_gather_object(facts, mine)
        strategy.barrier()
        if strategy.global_rank == 0:
            marker.unlink(missing_ok=True)
        problem = agreement_problem(facts, sharded_checkpoints=_writes_sharded_checkpoints(strategy))
        if problem:
            raise ConfigError(problem)
        fit = fitted_threads(facts, mine.rank)
        if fit is not None and mine.rank == min(f.rank for f in facts if f.host == mine.host):
            log.warning(
                "%d processes on %s share CPUs %s with %d threads in all: cut to %d each (set "
                "OMP_NUM_THREADS, or pin each node's processes to its own cores, e.g. with taskset, so that "
                "the work before this check fits too)",
                sum(1 for f in facts if f.host == mine.host), mine.host, _cpu_ranges(mine.cpus),
                sum(f.threads for f in facts if f.host == mine.host), fit,
            )  # fmt: skip
        if fit is not None:
            torch.set_num_threads(fit)


def _writes_sharded_checkpoints(strategy) -> bool:
    return bool(getattr(strategy, "_save_distributed_checkpoint", False)) and hasattr(strategy, "shard")


def _cpu_ranges(cpus: tuple[int, ...]) -> str:
    return (
        f"{cpus[0]}-{cpus[-1]}"
        if cpus and list(cpus) == list(range(cpus[0], cpus[-1] + 1))
        else ",".join(map(str, cpus))
    )
