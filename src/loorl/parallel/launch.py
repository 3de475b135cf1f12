"""What the launcher gave this process, read from its environment before any model loads: how many
processes share its node, and so how many CPU threads its matrix products may use. (Its global rank
is Lightning's `rank_zero_only.rank`, read from the same environment when Lightning is imported.)

torchrun, SLURM's srun and Lightning's own launcher start the processes of a multi-process run; each
describes the placement in its own variables. Threads are set here, first thing in a run, because
every process's OpenMP pool otherwise takes every core of the machine: two processes with two threads
each on two cores stalled a tiny model's 5-second build for minutes (OpenMP's spin-waiting threads
fight over the cores). Lightning sets threads too, but only when its own launcher starts the processes
and only once `fit` begins, after the model is built; torchrun sets OMP_NUM_THREADS=1 only when it
starts more than one process per node.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_only

log = logging.getLogger("loorl")


def slurm_tasks_on_this_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this srun step on this node, from SLURM_STEP_TASKS_PER_NODE (or the job's
    SLURM_TASKS_PER_NODE), whose form is `2`, `2(x3)` or `2(x2),1` (one entry per run of nodes;
    SLURM_NODEID picks the entry). None outside an srun step."""
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or (
        env.get("SLURM_TASKS_PER_NODE") if "SLURM_STEP_ID" in env else None
    )
    if not raw:
        return None
    per_node: list[int] = []
    for part in raw.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    return per_node[node] if node < len(per_node) else per_node[-1]


def lightning_launched_processes(cfg) -> int:
    """The processes Lightning's own launcher will start on this machine (`trainer.devices` of the run's
    config; torchrun and srun describe their own launches in the environment, which wins)."""
    devices = cfg.trainer.get("devices", 1)
    return int(devices) if str(devices).isdigit() else 1


def processes_on_this_node(env: Mapping[str, str], *, lightning_devices: int = 1) -> tuple[int, str]:
    """How many processes of the run share this node, and which launcher said so: torchrun's
    LOCAL_WORLD_SIZE, srun's tasks on this node, else `trainer.devices` (Lightning's own launcher
    starts that many on this machine)."""
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(env["LOCAL_WORLD_SIZE"]), "torchrun's LOCAL_WORLD_SIZE"
    tasks = slurm_tasks_on_this_node(env)
    if tasks:
        return tasks, "srun's tasks on this node"
    if lightning_devices > 1:
        return lightning_devices, "trainer.devices (Lightning's launcher)"
    return 1, "one process"


class Threads(NamedTuple):
    count: int  # torch's intra-op threads for this process
    reason: str  # where the number came from, for the log


def intra_op_threads(env: Mapping[str, str], *, cpus_available: int, lightning_devices: int = 1) -> Threads:
    """The intra-op thread count this process should use (pure: the environment and CPU count in).

    An explicit OMP_NUM_THREADS wins; then SLURM_CPUS_PER_TASK (what SLURM allotted this task); else
    the CPUs this process may run on (its affinity), split evenly over the processes of its node."""
    explicit = env.get("OMP_NUM_THREADS", "")
    if explicit.isdigit() and int(explicit) > 0:
        return Threads(int(explicit), "OMP_NUM_THREADS")
    slurm = env.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0 and "SLURM_JOB_ID" in env:
        return Threads(int(slurm), "SLURM_CPUS_PER_TASK")
    procs, source = processes_on_this_node(env, lightning_devices=lightning_devices)
    return Threads(
        max(1, cpus_available // procs),
        f"{cpus_available} CPUs in this process's affinity / {procs} processes on this node ({source})",
    )


def cpu_set() -> tuple[int, ...]:
    """The CPUs this process may run on (taskset, cgroups' cpusets and SLURM's task binding narrow it)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux: every CPU
        return tuple(range(os.cpu_count() or 1))


_omp_set_here: str | None = None  # the OMP_NUM_THREADS this process wrote (not the user's choice)


def configure_threads(*, lightning_devices: int = 1) -> Threads:
    """Set torch's intra-op threads (and OMP_NUM_THREADS, which Lightning's launcher and its child
    processes then keep) from this process's placement; log the choice once, on rank 0."""
    global _omp_set_here
    env = dict(os.environ)
    if _omp_set_here is not None and env.get("OMP_NUM_THREADS") == _omp_set_here:
        del env["OMP_NUM_THREADS"]  # a later run in the same process (multirun) decides afresh
    threads = intra_op_threads(env, cpus_available=len(cpu_set()), lightning_devices=lightning_devices)
    torch.set_num_threads(threads.count)
    if "OMP_NUM_THREADS" not in env:
        _omp_set_here = os.environ["OMP_NUM_THREADS"] = str(threads.count)
    if rank_zero_only.rank == 0:
        log.info("intra-op threads: %d per process (%s)", threads.count, threads.reason)
    return threads
