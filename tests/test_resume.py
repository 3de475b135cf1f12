"""Exact resume: a run killed with SIGKILL and resumed, or stopped with SIGTERM and re-submitted, is
the run it replaces; checkpoints survive a kill while they are written; bad checkpoints fail in one
line before any model loads.

The runs are real CLI processes (`python src/train.py`), killed with real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import (
    DIGIT_TOOLS,
    ON_CPU,
    assert_same_run,
    metric_values,
    needs_vllm,
    needs_wandb,
    start_and_signal,
)
from loorl.cli.train import train
from loorl.errors import ConfigError
from loorl.training.checkpoints import (
    AtomicCheckpointIO,
    atomic_directory,
    complete_checkpoints,
    read_checkpoint,
)
from loorl.training.resume import previous_metrics_rows, resolve_resume

ROOT = Path(__file__).resolve().parents[1]
# the experiment (30 steps, a checkpoint every 10, killed after the second) at 12, 4 and 8 steps: the
# same kills, resumes and pruning (checkpoint_keep=2) in 40% of the steps
RL_STEPS, EVERY = 12, 4  # the steps; the checkpoints' and validations' interval
STEPS = [f"rl.steps={RL_STEPS}", f"checkpoint_every={EVERY}", f"val_every={EVERY}"]


def _command(run: Path, model_cache: Path, *overrides: str) -> list[str]:
    """The quick run on the CPU: resumes are compared bit for bit, which CUDA's kernels do not give
    (a GPU resume is statistically the same run; tests/test_gpu.py resumes one)."""
    cmd = [sys.executable, str(ROOT / "src" / "train.py"), "debug=quick", f"model.cache_dir={model_cache}"]
    return cmd + [*ON_CPU, *STEPS, f"hydra.run.dir={run}", *overrides]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _start_and_signal(cmd: list[str], wait_for: Path, sig: int, delay: float = 0.3) -> subprocess.Popen:
    """Start the run; once `wait_for` exists (and `delay` later), send `sig`; wait for the end."""
    return start_and_signal(cmd, wait_for, sig, env=_env(), delay=delay)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, model_cache) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    _run(_command(run, model_cache))
    return run


# ---- kill -9, then resume ------------------------------------------------------------------------
def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_run(uninterrupted, tmp_path, model_cache):
    run = tmp_path / "run"
    killed = _start_and_signal(
        _command(run, model_cache), run / "checkpoints" / "epoch=7-step=8.ckpt", signal.SIGKILL
    )
    assert killed.returncode == -signal.SIGKILL
    _run(_command(run, model_cache, "resume_from=auto"))  # the newest complete checkpoint: step 8
    assert_same_run(uninterrupted, run)
    # checkpoint_keep=2: the two newest periodic checkpoints stay, besides last.ckpt
    names = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert names == ["epoch=11-step=12.ckpt", "epoch=7-step=8.ckpt", "last.ckpt"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [pytest.param(("rollout=vllm",), marks=needs_vllm), ("strategy=fsdp", "trainer.devices=2")],
    ids=["vllm", "fsdp-2-processes"],
)
def test_other_engines_and_strategies_resume_to_the_same_run(tmp_path, model_cache, overrides):
    """vLLM's per-prompt seeds, FSDP's folders of shards: the same exactness as the HF engine."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    _run(_command(straight, model_cache, *overrides))
    first = run / "checkpoints" / "epoch=7-step=8.ckpt"
    killed = _start_and_signal(_command(run, model_cache, *overrides), first, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    _run(_command(run, model_cache, *overrides, "resume_from=auto"))
    assert_same_run(straight, run)


@pytest.mark.slow  # the default suite keeps LoRA's checkpoints (tests/test_lora.py) and an exact LoRA resume
# (tests/test_distributed.py, fsdp); moved here to pay for the vLLM server run (issue 67)
def test_a_killed_lora_run_resumes_to_the_same_run(tmp_path, model_cache):
    """LoRA with a KL term: the checkpoint holds only the adapters and their AdamW state, the frozen base
    weights come back from the model files, and the run continues as if never stopped."""
    pytest.importorskip("peft")
    lora = ("model.lora={r: 4}", "kl.coef=0.05")
    straight, run = tmp_path / "straight", tmp_path / "run"
    _run(_command(straight, model_cache, *lora))
    first = run / "checkpoints" / "epoch=7-step=8.ckpt"
    killed = _start_and_signal(_command(run, model_cache, *lora), first, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    state = read_checkpoint(first)["state_dict"]
    assert state and all(".lora_" in k for k in state)  # no frozen base weight
    _run(_command(run, model_cache, *lora, "resume_from=auto"))
    assert_same_run(straight, run)


@pytest.mark.parametrize(
    "overrides",
    [
        # slow: the prompt pools' case below resumes the same dynamic sampling, with the pools' state too
        pytest.param((), marks=pytest.mark.slow),
        pytest.param(("rollout.max_staleness=1", "rollout.devices=trainer"), marks=pytest.mark.slow),
        (
            "rl.prompt_pools.enabled=true",
            "rl.prompt_pools.retire_at=0.75",
            "rl.prompt_pools.weights.hard=0.5",
        ),
    ],
    ids=["synchronous", "one-step-off", "prompt-pools"],
)
def test_a_killed_run_with_dynamic_sampling_resumes_to_the_same_run(tmp_path, model_cache, overrides):
    """Dynamic sampling's rounds (their prompts, samples and counts) after a kill -9 are those of the
    run never stopped: every `dynamic/` metric and the rest, exactly. One step off, the rollout sampled
    ahead is checkpointed before its further rounds, which the resumed step draws with its weights.
    With pass-rate prompt pools every round's draw reads the pass rates the checkpoint kept."""
    ds = ("rl.dynamic_sampling.enabled=true", "rl.steps=9", "checkpoint_every=3", "val_every=3", *overrides)
    straight, run = tmp_path / "straight", tmp_path / "run"
    _run(_command(straight, model_cache, *ds))
    assert any(key == "dynamic/rounds" for key, _ in metric_values(straight))
    if "rl.prompt_pools.enabled=true" in overrides:
        retired = [
            float(v)
            for (key, _), values in metric_values(straight).items()
            if key == "pools/retired"
            for v in values
        ]
        assert retired and max(retired) > 0  # the pools moved: the resume has state to restore
        in_summary = json.loads((straight / "metrics.json").read_text())["history"]["pools/retired"]
        assert len(in_summary) == 9 and max(v for _, v in in_summary) == max(retired)  # metrics.json has them
    killed = _start_and_signal(_command(run, model_cache, *ds), run / "checkpoints" / "epoch=5-step=6.ckpt",
                               signal.SIGKILL)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    _run(_command(run, model_cache, *ds, "resume_from=auto"))
    assert_same_run(straight, run)


# ---- SIGTERM or Ctrl-C: checkpoint, summary, then the same command continues ----------------------
@pytest.mark.parametrize(  # Ctrl-C takes the same path as SIGTERM (one handler): slow, on request
    "sig",
    [pytest.param(signal.SIGTERM, marks=needs_wandb), pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
    ids=["SIGTERM", "Ctrl-C"],
)
def test_a_stop_signal_writes_a_checkpoint_and_summary_and_the_same_command_continues(
    uninterrupted, tmp_path, model_cache, sig
):
    """The command a preempted job re-submits continues the run: its metrics and (SIGTERM's case) its
    wandb run, offline here: two runs' folders of one run id."""
    run = tmp_path / "run"
    loggers = "logger=[csv,wandb]" if sig == signal.SIGTERM else "logger=[csv]"
    command = _command(run, model_cache, "resume_from=auto", loggers)
    stopped = _start_and_signal(command, run / "checkpoints" / "epoch=3-step=4.ckpt", sig)
    assert stopped.returncode == 0
    steps_done = json.loads((run / "metrics.json").read_text())["summary"]["rl_steps"]
    assert 4 <= steps_done < 12 and (run / "summary.md").exists()
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == steps_done
    started = list((run / "wandb").glob("offline-run-*"))
    _run(command)
    assert_same_run(uninterrupted, run)
    if "wandb" in loggers:
        runs = sorted((run / "wandb").glob("offline-run-*"))
        assert len(started) == 1 and len(runs) == 2 and started[0] in runs
        assert {r.name.rsplit("-", 1)[1] for r in runs} == {started[0].name.rsplit("-", 1)[1]}  # one run id


# ---- a kill while a checkpoint is written ----------------------------------------------------------
KILL_MID_WRITE = """
import os, signal, sys, torch
from loorl.training.checkpoints import AtomicCheckpointIO

path = sys.argv[1]
io = AtomicCheckpointIO()
io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, path)

def dies_half_way(checkpoint, filepath):  # the injected fault: torch.save killed half way
    with open(filepath, "wb") as f:
        f.write(b"PK\\x03\\x04 half a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

torch.save = dies_half_way
io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(3)}}, path)
"""


def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    proc = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(path)], env=_env(), timeout=120)
    assert proc.returncode == -signal.SIGKILL
    state = read_checkpoint(path)
    assert state["global_step"] == 1 and torch.equal(state["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # the half-written one
    assert complete_checkpoints(tmp_path) == [(1, path)]  # which the finder passes over


def test_atomic_checkpoint_io_replaces_a_file(tmp_path):
    path = tmp_path / "last.ckpt"
    for step in (1, 2):
        AtomicCheckpointIO().save_checkpoint({"global_step": step, "state_dict": {}}, path)
    assert read_checkpoint(path)["global_step"] == 2 and len(list(tmp_path.iterdir())) == 1


def test_a_sharded_checkpoint_is_swapped_in_whole_or_not_at_all(tmp_path):
    target = tmp_path / "checkpoints" / "last.ckpt"
    for step in (1, 2):
        with atomic_directory(target, is_writer=True, barrier=lambda: None) as tmp:
            torch.save({"global_step": step, "state_dict": {}}, tmp / "meta.pt")
    with pytest.raises(RuntimeError), atomic_directory(target, is_writer=True, barrier=lambda: None) as tmp:
        torch.save({"global_step": 3, "state_dict": {}}, tmp / "meta.pt")
        raise RuntimeError("killed while the shards are written")
    assert read_checkpoint(target)["global_step"] == 2
    assert complete_checkpoints(tmp_path) == [(2, target)]


# ---- bad input: one line before any model loads ----------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, quick_config) -> Path:
    run = tmp_path_factory.mktemp("ckpt") / "run"
    train(quick_config("rl.steps=2", "checkpoint_every=2", "export_policy=false", output_dir=run))
    return run / "checkpoints" / "last.ckpt"


def _error(quick_cfg, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        train(quick_cfg(*overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_resume_from_a_missing_file(quick_cfg, tmp_path):
    message = _error(quick_cfg, f"resume_from={tmp_path}/nope.ckpt")
    assert "does not exist" in message and "resume_from=auto" in message


@pytest.mark.parametrize("content", [b"not a checkpoint", "torch"], ids=["text", "other-torch-file"])
def test_resume_from_a_file_that_is_not_a_checkpoint(quick_cfg, tmp_path, content):
    bad = tmp_path / "bad.ckpt"
    if content == "torch":
        torch.save({"weights": torch.ones(2)}, bad)
    else:
        bad.write_bytes(content)
    message = _error(quick_cfg, f"resume_from={bad}")
    assert f"resume_from={bad} is not a Lightning checkpoint" in message


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.tiny.warm_start.max_steps=120", "model"),  # another tiny model (another cache key)
        ("optimizer._target_=torch.optim.Adam", "optimizer"),  # AdamW's state would load into Adam
        ("strategy=fsdp", "format"),
    ],
)
def test_resume_from_a_checkpoint_of_another_model_or_optimizer(quick_cfg, checkpoint, override, named):
    message = _error(quick_cfg, override, f"resume_from={checkpoint}")
    assert f"was written with {named}" in message and "this run has" in message


def test_resume_auto_needs_an_existing_output_dir(quick_config, tmp_path):
    with pytest.raises(ConfigError, match="resume_from=auto looks for checkpoints under output_dir="):
        train(quick_config("resume_from=auto", output_dir=tmp_path / "missing"))


def test_a_changed_run_setting_is_named_but_resumes(quick_cfg, checkpoint, caplog):
    summary = train(quick_cfg("rl.steps=3", "seed=5", f"resume_from={checkpoint}", "export_policy=false"))
    assert summary["rl_steps"] == 3
    assert "seed 0 -> 5" in caplog.text


def test_cli_prints_one_error_line_and_exits_2(tmp_path, model_cache):
    cmd = [sys.executable, str(ROOT / "src" / "train.py"), "debug=quick", f"model.cache_dir={model_cache}"]
    cmd += [f"hydra.run.dir={tmp_path / 'run'}", f"resume_from={tmp_path / 'nope.ckpt'}"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stdout.strip().splitlines()[-1].startswith(f"error: resume_from={tmp_path / 'nope.ckpt'}")


def test_a_checkpoint_carries_its_epoch_row_for_a_csv_killed_before_writing_it(tmp_path):
    """Lightning logs an epoch's training row after the epoch's checkpoint: a kill in between leaves the
    CSV without it, and the resumed run takes it from the checkpoint (EpochRow) instead."""
    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text(
        "epoch,rollout/reward,step,train/loss_step\n0,0.25,0,\n0,,0,0.5\n1,,1,0.75\n"  # epoch 1's row missing
    )
    row = {"epoch": 1, "step": 1, "values": {"rollout/reward": 0.5625}}
    state = {"global_step": 2, "epoch": 1, "state_dict": {}, "callbacks": {"EpochRow": {"row": row}}}
    torch.save(state, run / "last.ckpt")
    (run / "checkpoints").mkdir()
    os.replace(run / "last.ckpt", run / "checkpoints" / "last.ckpt")
    resume = resolve_resume(str(run / "checkpoints" / "last.ckpt"), run, {"load": {}, "run": {}})
    assert (resume.epoch, resume.epoch_row) == (1, row)  # read from the checkpoint, once
    rows = previous_metrics_rows(resume)
    assert [(r["epoch"], r["step"], r.get("rollout/reward", "")) for r in rows] == [
        ("0", "0", "0.25"), ("0", "0", ""), ("1", "1", ""), ("1", "1", "0.5625")
    ]  # fmt: skip
    # a CSV that has it already is left as it is
    (run / "csv" / "metrics.csv").write_text("epoch,rollout/reward,step\n1,0.5625,1\n")
    assert len(previous_metrics_rows(resume)) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [(), ("rollout.max_staleness=1", "rollout.devices=trainer")],
    ids=["synchronous", "one-step-off"],
)
def test_a_killed_run_with_tools_resumes_to_the_same_run(tmp_path, model_cache, overrides):
    """Multi-turn rollouts with tools after a kill -9: every `tools/` metric and the rest, exactly. One
    step off, the tools run in the sampler's turn loop and the rollout sampled ahead is checkpointed."""
    tools = (*DIGIT_TOOLS, "rl.steps=12", "checkpoint_every=4", "val_every=6", *overrides)
    straight, run = tmp_path / "straight", tmp_path / "run"
    _run(_command(straight, model_cache, *tools))
    calls = [
        float(v[0]) for (key, _), v in metric_values(straight).items() if key == "tools/calls_per_sample"
    ]
    assert calls and max(calls) > 0
    first = run / "checkpoints" / "epoch=7-step=8.ckpt"
    killed = _start_and_signal(_command(run, model_cache, *tools), first, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    _run(_command(run, model_cache, *tools, "resume_from=auto"))
    assert_same_run(straight, run)
