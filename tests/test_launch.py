"""Placement read from the launcher's environment (threads, ranks), the checks the ranks of a
multi-process run agree on, one build per cache entry, and how a lost peer is told. Pure functions
and small real processes; the multi-node runs themselves are in tests/test_multinode.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loorl.parallel.distributed import lost_peer
from loorl.parallel.launch import (
    intra_op_threads,
    processes_on_this_node,
    slurm_tasks_on_this_node,
)
from loorl.resolvers import RANK_VARIABLES, launch_rank, on_rank_zero, per_rank
from loorl.training.graceful_stop import GracefulStop, slurm_environment
from loorl.training.rank_checks import RankFacts, agreement_problem, fitted_threads
from loorl.util.build_once import build_once


# ---- threads ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, cpus, devices, expected, source",
    [
        ({}, 16, 1, 16, "1 processes on this node (one process)"),
        ({"OMP_NUM_THREADS": "3"}, 16, 1, 3, "OMP_NUM_THREADS"),  # explicit wins over everything
        (
            {"OMP_NUM_THREADS": "3", "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "8"},
            16,
            1,
            3,
            "OMP_NUM_THREADS",
        ),
        ({"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "4"}, 16, 1, 4, "SLURM_CPUS_PER_TASK"),
        ({"SLURM_CPUS_PER_TASK": "4"}, 16, 1, 16, "one process"),  # a stale variable outside a job
        ({"LOCAL_WORLD_SIZE": "4"}, 16, 1, 4, "torchrun's LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "1"}, 2, 1, 2, "torchrun's LOCAL_WORLD_SIZE"),  # one process per "node"
        (
            {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2"},
            2,
            1,
            1,
            "srun's tasks",
        ),
        ({}, 2, 2, 1, "trainer.devices (Lightning's launcher)"),
        ({}, 1, 4, 1, "trainer.devices"),  # never below one thread
        ({"OMP_NUM_THREADS": "0"}, 8, 2, 4, "trainer.devices"),  # 0 is not a choice
    ],
)
def test_threads_come_from_what_the_launcher_gave(env, cpus, devices, expected, source):
    threads = intra_op_threads(env, cpus_available=cpus, lightning_devices=devices)
    assert threads.count == expected
    assert source in threads.reason


@pytest.mark.parametrize(
    "raw, node, expected",
    [("2", "0", 2), ("2(x3)", "2", 2), ("4(x2),1", "2", 1), ("4(x2),1", "1", 4), ("3,1", "1", 1)],
)
def test_srun_tasks_per_node_forms(raw, node, expected):
    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": raw, "SLURM_NODEID": node}
    assert slurm_tasks_on_this_node(env) == expected
    assert processes_on_this_node(env)[0] == expected


def test_no_srun_step_no_slurm_task_count():
    # the batch script itself (no step): its SLURM_TASKS_PER_NODE describes the job, not this process
    assert slurm_tasks_on_this_node({"SLURM_TASKS_PER_NODE": "2"}) is None


def test_hydra_outputs_are_written_by_rank_zero_only(monkeypatch):
    """The resolvers follow the rank Lightning read from torchrun's, srun's or its own launcher's
    environment (`rank_zero_only.rank`)."""
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 0)
    assert (on_rank_zero(".hydra"), per_rank("train")) == (".hydra", "train")
    monkeypatch.setattr(rank_zero_only, "rank", 2)
    assert (on_rank_zero(".hydra"), per_rank("train")) == (None, "train_rank2")


@pytest.mark.parametrize(
    "env, rank",
    [({"RANK": "1", "LOCAL_RANK": "0"}, 1), ({"LOCAL_RANK": "1"}, 1), ({"SLURM_PROCID": "3"}, 3), ({}, 0)],
    ids=["torchrun-second-node", "lightning-launcher", "srun", "one-process"],
)
def test_before_lightning_loads_the_rank_is_read_from_the_launchers_environment(monkeypatch, env, rank):
    """A run's config resolves before Lightning loads: the rank is the environment's. torchrun's second
    node of one process each has LOCAL_RANK=0 and RANK=1, and RANK wins: it writes train_rank1.log, not a
    second train.log over rank 0's (the two-node runs of tests/test_multinode.py, slow)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    monkeypatch.delattr(rank_zero_only, "rank", raising=False)  # as before Lightning's import sets it
    for key in RANK_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch_rank() == rank
    assert per_rank("train") == ("train" if rank == 0 else f"train_rank{rank}")


# ---- what the ranks agree on -----------------------------------------------------------------------
def _facts(rank, *, host="a", cpus=(0, 1), threads=1, resume=None, sees=True) -> RankFacts:
    return RankFacts(rank, host, tuple(cpus), threads, resume, sees)


def test_ranks_that_resume_from_different_steps_stop_with_one_line():
    facts = [_facts(0, resume=20), _facts(1, resume=None, sees=False)]
    problem = agreement_problem(facts, sharded_checkpoints=False)
    assert "rank 0 resumes after step 20, rank 1 starts fresh" in problem
    assert "not one shared folder" in problem and "\n" not in problem
    assert agreement_problem([_facts(0, resume=20), _facts(1, resume=20)], sharded_checkpoints=True) is None


def test_sharded_checkpoints_need_a_shared_folder():
    facts = [_facts(0), _facts(1, host="b", sees=False)]
    assert "save_distributed_checkpoint=false" in agreement_problem(facts, sharded_checkpoints=True)
    assert agreement_problem(facts, sharded_checkpoints=False) is None  # DDP: rank 0 writes one file


def test_threads_are_cut_only_where_processes_share_cores():
    shared = [_facts(0, threads=2), _facts(1, threads=2)]  # two "nodes" on one 2-core host, unpinned
    assert [fitted_threads(shared, r) for r in (0, 1)] == [1, 1]
    pinned = [_facts(0, cpus=(0,), threads=1), _facts(1, cpus=(1,), threads=1)]
    assert fitted_threads(pinned, 0) is None
    hosts = [_facts(0, host="a", threads=2), _facts(1, host="b", threads=2)]  # two real machines
    assert fitted_threads(hosts, 1) is None
    wide = [_facts(r, cpus=range(16), threads=16) for r in range(4)]  # 4 processes, 16 cores
    assert fitted_threads(wide, 3) == 4


# ---- one build per cache entry ---------------------------------------------------------------------
def _build_in_process(entry: str, log: str, start: float) -> None:
    def build():
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough for the other process to find the entry missing
        Path(entry).mkdir()
        (Path(entry) / "done").write_text("ok")

    time.sleep(max(0.0, start - time.time()))
    build_once(Path(entry), done=lambda: (Path(entry) / "done").exists(), build=build, what="a test entry")


def test_processes_that_find_an_entry_missing_together_build_it_once(tmp_path):
    entry, log = tmp_path / "cache" / "entry", tmp_path / "builds.log"
    start = time.time() + 1.0  # both start at once
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_build_in_process, args=(str(entry), str(log), start)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert log.read_text() == "built\n"
    assert (entry / "done").read_text() == "ok"


# ---- a lost peer -----------------------------------------------------------------------------------
def test_a_gloo_failure_is_told_in_its_first_sentence():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:50339: Connection "
        "reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    assert lost_peer(gloo) == "Read error [127.0.0.1]:50339: Connection reset by peer"
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("while logging") from inner
    except ValueError as outer:
        assert lost_peer(outer) == "Read error [127.0.0.1]:50339: Connection reset by peer"
    assert lost_peer(dist.DistBackendError("NCCL watchdog timeout")) == "NCCL watchdog timeout"
    assert lost_peer(RuntimeError("CUDA out of memory")) is None  # not every RuntimeError
    assert lost_peer(torch.cuda.OutOfMemoryError("x")) is None


# ---- who owns the requeue signal ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "sig, job, requeue",
    [(signal.SIGUSR1, "42", True), (signal.SIGUSR1, None, False), (signal.SIGTERM, "42", False)],
)
def test_only_sigusr1_inside_a_slurm_job_asks_for_a_requeue(sig, job, requeue, monkeypatch, tmp_path):
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    if job:
        monkeypatch.setenv("SLURM_JOB_ID", job)
    stop = GracefulStop(tmp_path / "last.ckpt")
    stop._request(sig, None)
    assert stop.requested == signal.Signals(sig).name  # every one of them checkpoints and stops
    assert stop.requeue_wanted is requeue


def test_lightning_keeps_its_slurm_environment_without_its_requeue_handler(monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    assert slurm_environment() == []  # not under srun: Lightning's own detection picks the environment
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "loorl")
    (env,) = slurm_environment()
    assert type(env).__name__ == "SLURMEnvironment" and env.auto_requeue is False
