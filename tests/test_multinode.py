"""Two nodes on one machine, through the real launcher: two `torchrun` agents (one per "node", one
process each, c10d rendezvous on localhost), each with its own model cache and its own half of the
CPUs (as two machines would have), train as one node of two processes does; outputs are written once;
a dead or hung rank ends the run; a multi-node checkpoint resumes to the same run.

The default suite's two-node run is tests/test_distributed.py's `test_two_torchrun_nodes_train_as_one_node`,
beside the one-node run of two processes it is compared with (trained once there, for both tests).

What one machine cannot show: real network latency, InfiniBand, NCCL, and hosts that die without
closing their connections (the hang test stands in for the last one: a stopped process holds its
connections open, so only `trainer.strategy.timeout` ends the wait).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fixtures import ON_CPU, assert_run_outputs, assert_same_run, child_env, free_port
from loorl.training.checkpoints import complete_checkpoints, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["debug=quick", *ON_CPU, "trainer.enable_progress_bar=false"]


def _env(**extra: str) -> dict:
    env = child_env(TOKENIZERS_PARALLELISM="false", **extra)
    for key in (
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "OMP_NUM_THREADS",
    ):  # each process decides its own threads
        env.pop(key, None)
    return env


def _cpu_halves() -> list[list[int]]:
    """This machine's CPUs split in two, one half per "node" (both the same CPU on a 1-CPU machine)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return [cpus[:half], cpus[half:] or cpus[:half]]


class TwoNodes:
    """Two torchrun agents started together; `wait()` returns their exit codes. Node n runs in
    `run_dirs[n]` with `caches[n]`, pinned to its half of the CPUs."""

    def __init__(
        self, tmp: Path, run_dirs: list[Path], caches: list[Path], *overrides: str, pin: bool = True
    ):
        port = free_port()
        self.logs = [tmp / f"node{n}.log" for n in (0, 1)]
        self.agents = []
        for n in (0, 1):
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                      "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]  # fmt: skip
            train = [str(ROOT / "src" / "train.py"), *QUICK, "trainer.num_nodes=2", "trainer.devices=1"]
            cmd = launch + train + [f"hydra.run.dir={run_dirs[n]}", *overrides]
            if pin:
                cmd = ["taskset", "-c", ",".join(map(str, _cpu_halves()[n])), *cmd]
            with self.logs[n].open("w") as log:
                self.agents.append(
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=_env(LOORL_CACHE=str(caches[n])), stdout=log, stderr=log
                    )
                )

    def wait(self, timeout: float = 600) -> list[int]:
        return [agent.wait(timeout=timeout) for agent in self.agents]

    def output(self, n: int) -> str:
        return self.logs[n].read_text()

    def worker(self, rank: int) -> int:
        """The pid of the training process with global rank `rank` (a child of one of the agents)."""
        for agent in self.agents:
            for child in self.workers(agent):
                if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                    return child
        raise AssertionError(f"no worker of rank {rank}")

    def workers(self, agent: subprocess.Popen) -> list[int]:
        try:
            return [
                int(pid) for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
            ]
        except FileNotFoundError:  # the agent is gone
            return []

    def kill(self) -> None:
        """SIGKILL every worker and agent still running (a kill -9 of the whole job)."""
        for agent in self.agents:
            for pid in self.workers(agent):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if agent.poll() is None:
                agent.kill()


def policy_difference(a: Path, b: Path) -> float:
    """The largest difference between the two exported policies' tensors, relative to each tensor's
    largest magnitude."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "policy" / "model.safetensors"), load_file(b / "policy" / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max() / wa[k].abs().max().clamp_min(1e-12)) for k in wa)


def node_caches(tmp: Path, model_cache: Path) -> list[Path]:
    """A copy of the session's model cache per node: each "node" has its own disk."""
    caches = [tmp / f"cache{n}" for n in (0, 1)]
    for cache in caches:
        shutil.copytree(model_cache, cache, ignore=shutil.ignore_patterns("*.lock"))
    return caches


@pytest.mark.slow
def test_a_folder_per_node_gets_one_writer_and_refuses_a_resume_it_cannot_agree_on(tmp_path):
    """Run folders that are not shared (one per node) and one empty model cache that is (both nodes
    find it empty at once: one builds, the other waits and loads)."""
    folders, cache = [tmp_path / "node0_run", tmp_path / "node1_run"], tmp_path / "shared_cache"
    nodes = TwoNodes(tmp_path, folders, [cache, cache], "strategy=ddp")
    assert nodes.wait() == [0, 0], nodes.output(0)[-3000:] + nodes.output(1)[-3000:]
    both = nodes.output(0) + nodes.output(1)
    assert both.count("] - building the tiny model into") == 1
    assert both.count("waiting for another process to finish building the tiny model") == 1
    writer = next(f for f in folders if (f / "summary.md").exists())
    other = next(f for f in folders if f != writer)
    assert_run_outputs(writer)
    assert complete_checkpoints(writer)
    assert sorted(p.name for p in other.rglob("*") if p.is_file()) == ["train_rank1.log"]

    # resume_from=auto finds last.ckpt in rank 0's folder only: every rank stops with the same line
    nodes = TwoNodes(tmp_path, folders, [cache, cache], "strategy=ddp", "resume_from=auto")
    assert nodes.wait() != [0, 0]
    for n in (0, 1):
        said = "rank 0 resumes after step 4, rank 1 starts fresh) (output_dir is not one shared folder"
        assert f"error: the processes do not resume from the same checkpoint ({said}" in nodes.output(n)

    # FSDP's sharded checkpoint cannot be split over two folders
    nodes = TwoNodes(tmp_path, [tmp_path / "f0", tmp_path / "f1"], [cache, cache], "strategy=fsdp")
    assert nodes.wait() != [0, 0]
    assert "trainer.strategy.save_distributed_checkpoint=false" in nodes.output(0) + nodes.output(1)


@pytest.mark.slow
def test_a_two_node_fsdp_run_killed_after_a_checkpoint_resumes_to_the_same_run(tmp_path, model_cache):
    caches = node_caches(tmp_path, model_cache)
    steps = ["strategy=fsdp", "rl.steps=8", "checkpoint_every=2", "val_every=2"]
    straight = tmp_path / "straight"
    assert TwoNodes(tmp_path, [straight, straight], caches, *steps).wait() == [0, 0]

    run = tmp_path / "killed"
    nodes = TwoNodes(tmp_path, [run, run], caches, *steps, "resume_from=auto")
    deadline = time.time() + 300
    while not (run / "checkpoints" / "epoch=3-step=4.ckpt").is_dir() and time.time() < deadline:
        time.sleep(0.05)
    nodes.kill()  # both agents and their workers, mid-run
    nodes.wait()
    found = complete_checkpoints(run)
    assert found and 4 <= found[-1][0] < 8

    nodes = TwoNodes(tmp_path, [run, run], caches, *steps, "resume_from=auto")
    assert nodes.wait() == [0, 0], nodes.output(0)[-3000:]
    assert "resuming from" in nodes.output(0) + nodes.output(1)
    assert_same_run(straight, run)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, timeout_s, bound_s",
    [("kill -9", 600, 30), ("stopped (SIGSTOP: a rank that hangs)", 20, 60)],
    ids=["killed", "hung"],
)
def test_a_dead_rank_ends_the_run_within_a_bound_and_the_last_checkpoint_loads(
    how, timeout_s, bound_s, tmp_path, model_cache
):
    run = tmp_path / "run"
    overrides = ["strategy=ddp", "rl.steps=500", "checkpoint_every=2", "val_every=100",
                 f"trainer.strategy.timeout.seconds={timeout_s}"]  # fmt: skip
    nodes = TwoNodes(tmp_path, [run, run], node_caches(tmp_path, model_cache), *overrides)
    try:
        deadline = time.time() + 300
        while not (run / "checkpoints" / "epoch=3-step=4.ckpt").exists() and time.time() < deadline:
            time.sleep(0.05)
        victim = nodes.worker(1)
        survivor = next(a for a in nodes.agents if victim not in nodes.workers(a))
        os.kill(victim, signal.SIGKILL if how == "kill -9" else signal.SIGSTOP)
        started = time.time()
        survivor.wait(timeout=bound_s + 60)
        took = time.time() - started
    finally:
        nodes.kill()
        if how != "kill -9":
            os.kill(victim, signal.SIGKILL)
    print(f"{how}: the survivor's launcher exited {took:.1f} s later")
    assert took <= bound_s
    assert survivor.returncode != 0
    assert "lost another process of the run" in nodes.output(nodes.agents.index(survivor))
    # every checkpoint whole (written atomically), the newest at least the step-4 one the kill waited for
    # (last.ckpt may still be step 2's: ModelCheckpoint writes it just after the periodic one)
    found = complete_checkpoints(run)
    assert found[-1][0] >= 4 and any(path.name == "last.ckpt" for _, path in found)
    for _, path in found:
        assert torch.is_tensor(next(iter(read_checkpoint(path)["state_dict"].values())))
