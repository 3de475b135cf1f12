"""A real SLURM: a one-node cluster on this machine (`scripts/cluster/cluster.sh`: munge, slurmctld and
slurmd on localhost), the repository's own batch script submitted with `sbatch`, a job signalled
before its time limit that requeues itself and resumes to the uninterrupted run, and a Hydra sweep
through the submitit launcher.

Needs root and Debian's slurm-wlm and munge (`bash scripts/cluster/cluster.sh install`); skips with the
reason otherwise. A cluster already up is used and left up; one the tests start is shut down after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import ON_CPU, assert_run_outputs, assert_same_run, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster" / "cluster.sh"
BATCH = ROOT / "scripts" / "cluster" / "train.sbatch"
SERVERS_BATCH = ROOT / "scripts" / "cluster" / "servers.sbatch"
QUICK = ["debug=quick", *ON_CPU]
LONG = [*QUICK, "rl.steps=200", "val_every=50", "val_pass_k=0", "checkpoint_every=20"]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory, model_cache) -> dict:
    """The environment a job is submitted with: the cluster's SLURM_CONF, this interpreter first on
    PATH (the batch script runs `python`), the session's model cache."""
    if os.geteuid() != 0:
        pytest.skip("a SLURM cluster on this machine needs root (munged, slurmctld, slurmd)")
    if not all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        pytest.skip("SLURM is not installed: `bash scripts/cluster/cluster.sh install` (Debian, root)")
    was_up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True).returncode == 0
    up = subprocess.run(["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    conf = up.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    env = dict(os.environ, SLURM_CONF=conf, LOORL_CACHE=str(model_cache), TOKENIZERS_PARALLELISM="false")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for key in ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    yield env
    if not was_up:
        subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, timeout=120)


def _sbatch(env: dict, run: Path, log: Path, *overrides: str, wait: bool) -> subprocess.CompletedProcess:
    cmd = ["sbatch", "--parsable", f"--output={log}", *(["--wait"] if wait else []), str(BATCH), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=dict(env, LOORL_RUN_DIR=str(run)), capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def job_record(env: dict, job: str, *, show: bool = True) -> dict[str, str]:
    """`scontrol show job`'s fields of a job (kept MinJobAge seconds after it ends); `show` prints the
    record into the test's output (pytest -s)."""
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    if show:
        print(out)
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _job_id(done: subprocess.CompletedProcess) -> str:
    return done.stdout.strip().splitlines()[0].split(";")[0]


def test_the_batch_script_trains_on_a_real_cluster(slurm_env, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    done = _sbatch(slurm_env, run, log, *QUICK, wait=True)
    assert done.returncode == 0, log.read_text()[-3000:]
    record = job_record(slurm_env, _job_id(done))
    assert (record["JobState"], record["ExitCode"], record["NumTasks"]) == ("COMPLETED", "0:0", "2")
    out = log.read_text()
    assert out.count("## rloo on arithmetic") == 1  # one summary from two tasks
    assert "intra-op threads: 1 per process (SLURM_CPUS_PER_TASK)" in out
    assert "auto-requeueing" not in out  # Lightning's SLURM requeue handler is off: loorl's owns the signal
    assert sorted(p.name for p in run.glob("*.log")) == ["train.log", "train_rank1.log"]
    assert_run_outputs(run)


def test_a_job_signalled_before_its_limit_requeues_and_resumes_to_the_same_run(slurm_env, tmp_path):
    straight = tmp_path / "straight"
    assert _sbatch(slurm_env, straight, tmp_path / "straight.out", *LONG, wait=True).returncode == 0

    run, log = tmp_path / "preempted", tmp_path / "preempted.out"
    job = _job_id(_sbatch(slurm_env, run, log, *LONG, wait=False))
    deadline = time.time() + 300
    while not (run / "checkpoints" / "epoch=19-step=20.ckpt").exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # mid-run, between two checkpoints
    # what `#SBATCH --signal=USR1@120` sends 120 s before the time limit, to every task
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True)
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    while job_record(slurm_env, job, show=False).get("JobState") not in ended:
        assert time.time() < deadline + 300, "the requeued job did not finish"
        time.sleep(2)
    record = job_record(slurm_env, job)
    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "1", "0:0")
    out = log.read_text()  # --open-mode=append: both runs of the job
    assert "restart 0" in out and "restart 1" in out and f"requeued SLURM job {job}" in out
    stopped_at = int(re.search(r"stopped after RL step (\d+)", out).group(1))
    assert 20 <= stopped_at < 200 and f"(step {stopped_at})" in out  # resumed from the signal's checkpoint
    assert not list(run.rglob("hpc_ckpt*"))  # one kind of checkpoint
    # every output whole: each step once in the CSV with its own values, the summary's history and plot
    assert_same_run(straight, run)
    assert (run / "samples.csv").read_text() == (straight / "samples.csv").read_text()


def test_a_hydra_sweep_runs_as_slurm_jobs_through_submitit(slurm_env, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    sweep = tmp_path / "sweep"
    # a CPU-only one-node cluster: no GPUs to ask for, 1 CPU and 1 GB a job
    launcher = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
                "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]  # fmt: skip
    cmd = [sys.executable, "src/train.py", "-m", *launcher, *QUICK, "seed=0,1", f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(cmd, cwd=ROOT, env=slurm_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for job in ("0", "1"):
        assert (sweep / job / "summary.md").exists(), job
        assert f"seed: {job}" in (sweep / job / "config.yaml").read_text()
    assert len(list((sweep / ".submitit").glob("*_[01]/*_log.out"))) == 2  # two SLURM jobs ran them


def test_the_servers_batch_script_trains_with_a_vllm_server_beside_it(slurm_env, tmp_path):
    """scripts/cluster/servers.sbatch on the one-node cluster: a vLLM server (scripts/cluster/serve.py) and
    the trainer share the node, the trainer waits for the server and trains one step behind it."""
    pytest.importorskip("vllm")
    run, log = tmp_path / "run", tmp_path / "job.out"
    env = dict(slurm_env, LOORL_RUN_DIR=str(run), LOORL_SERVER_PORT=str(free_port()))
    overrides = ["debug=quick", "trainer.accelerator=cpu", "rollout.max_staleness=1"]
    cmd = ["sbatch", "--parsable", f"--output={log}", "--wait", str(SERVERS_BATCH), *overrides]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, log.read_text()[-3000:]
    record = job_record(slurm_env, _job_id(done))
    for _ in range(30):  # the servers' step may still be ending (COMPLETING) when sbatch --wait returns
        if record["JobState"] != "COMPLETING":
            break
        time.sleep(1)
        record = job_record(slurm_env, _job_id(done), show=False)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0")
    lags = json.loads((run / "metrics.json").read_text())["history"]["rollout/policy_lag"]
    assert [v for _, v in lags] == [0.0, 1.0, 1.0, 1.0]
    assert list(run.glob("server-*.log")), sorted(p.name for p in run.iterdir())
