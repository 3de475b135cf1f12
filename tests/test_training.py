"""End-to-end runs of `train(cfg)` on the quick tiny config: real Lightning, real HF generation."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from fixtures import ON_CPU
from loorl.algo import estimators
from loorl.cli.train import train
from loorl.util.profiling import PHASES


def _history(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())["history"]


def _deterministic(history):
    return {k: v for k, v in history.items() if not k.startswith("perf/")}


def test_quick_run_writes_every_output(quick_cfg, tmp_path):
    cfg = quick_cfg()
    summary = train(cfg)
    run = tmp_path / "run"
    assert summary["rl_steps"] == cfg.rl.steps and summary["optimizer_steps"] == cfg.rl.steps
    assert 0 <= summary["val_accuracy_start"] <= 1 and 0 <= summary["val_accuracy_end"] <= 1
    text = (run / "summary.md").read_text()
    assert "held-out greedy accuracy" in text and "tokens/s" in text
    assert summary["peak_host_gib"] > 0.2
    assert f"| peak memory | {summary['peak_host_gib']:.2f} GiB resident on the host" in text
    png = (run / "learning_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    with open(run / "csv" / "metrics.csv") as f:
        columns = set(next(csv.reader(f)))
    expected = {
        "rollout/reward",
        "rollout/reward_std",
        "rollout/accuracy",
        "rollout/completion_len",
        "rollout/zero_std_group_frac",
        "rollout/truncated_frac",
        "train/loss_step",
        "train/entropy",
        "train/clip_frac",
        "train/grad_norm",
        "perf/gen_tokens_per_s",
        "perf/train_tokens_per_s",
        "perf/train_tokens",
        *(f"perf/{phase}_seconds" for phase in ("step", *PHASES)),
        "val/accuracy",
    }
    assert expected <= columns, expected - columns
    with open(run / "csv" / "metrics.csv") as f:
        steps = [r for r in csv.DictReader(f) if r["perf/step_seconds"]]
    for row in steps:  # the phases and the rest add up to the step; every phase that ran took time
        parts = sum(float(row[f"perf/{p}_seconds"] or 0) for p in PHASES)
        assert abs(parts - float(row["perf/step_seconds"])) < 1e-6
        assert min(float(row[f"perf/{p}_seconds"]) for p in ("gen", "forward", "backward", "optimizer")) > 0
    assert "seconds per step (median): whole; phases" in text
    history = _history(run)
    assert [s for s, _ in history["val/accuracy"]] == [0, 2, 4]  # before training, then every val_every
    assert len(history["rollout/reward"]) == cfg.rl.steps
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert (run / "config.yaml").exists()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run / "policy")
    assert (run / "policy" / "tokenizer.json").exists()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    name = "model.embed_tokens.weight"
    assert torch.equal(exported.state_dict()[name], ckpt["state_dict"][f"policy.{name}"])


def test_same_seed_same_metrics(quick_cfg, tmp_path):
    """Bit for bit on the CPU (README); CUDA's kernels repeat a run only statistically."""
    a = train(quick_cfg(f"output_dir={tmp_path}/a", "rl.steps=3", *ON_CPU))
    b = train(quick_cfg(f"output_dir={tmp_path}/b", "rl.steps=3", *ON_CPU))
    c = train(quick_cfg(f"output_dir={tmp_path}/c", "rl.steps=3", "seed=1", *ON_CPU))
    ha, hb, hc = (_deterministic(_history(tmp_path / x)) for x in "abc")
    assert ha == hb
    assert ha != hc
    assert a["val_accuracy_end"] == b["val_accuracy_end"]
    assert not math.isnan(c["reward_last"])


# what an estimator needs of the run beyond the default (GDPO: two reward functions, their sum unclipped)
ESTIMATOR_NEEDS = {"gdpo": ("reward=custom", "reward.clip=null")}


@pytest.mark.parametrize("name", estimators.names())
def test_every_estimator_trains(quick_cfg, tmp_path, name):
    cfg = quick_cfg(f"estimator={name}", *ESTIMATOR_NEEDS.get(name, ()), "rl.steps=2", "val_every=5",
                    "checkpoint_every=0")  # fmt: skip
    summary = train(cfg)
    history = _history(tmp_path / "run")
    losses = [v for _, v in history["train/loss"]]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert summary["optimizer_steps"] == 2
    greedy = [v for _, v in history.get("rollout/greedy_samples", [])]  # ReMax's baselines, counted
    assert greedy == ([float(cfg.rl.prompts_per_step)] * 2 if name == "remax" else [])


def test_kl_in_reward_loads_reference_and_logs_kl(quick_cfg, tmp_path):
    train(quick_cfg("kl.coef=0.1", "kl.estimator=k1", "rl.steps=3", "checkpoint_every=0"))
    history = _history(tmp_path / "run")
    kls = [v for _, v in history["rollout/kl"]]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # the first rollout comes from the reference itself
    # the policy has moved away from it (k1's sample mean is unbiased but may be negative)
    assert abs(kls[-1]) > 1e-4
    assert [v for _, v in history["rollout/kl_coef"]] == pytest.approx([0.1, 0.1, 0.1])


def test_kl_as_loss_term_and_adaptive_coefficient(quick_cfg, tmp_path):
    train(
        quick_cfg(
            "kl.coef=0.1",
            "kl.in_reward=false",
            "kl.estimator=k3",
            "kl.adaptive=true",
            "kl.target=0.001",
            "kl.horizon=100",
            "rl.steps=3",
            "checkpoint_every=0",
        )
    )
    history = _history(tmp_path / "run")
    assert "train/kl" in history
    coefs = [v for _, v in history["rollout/kl_coef"]]
    assert coefs[0] == pytest.approx(0.1) and coefs[-1] != coefs[0]


def test_off_policy_minibatches_use_clipped_surrogate(quick_cfg, tmp_path):
    summary = train(
        quick_cfg("rl.prompts_per_minibatch=4", "rl.epochs_per_rollout=2", "rl.steps=2", "checkpoint_every=0")
    )
    assert summary["optimizer_steps"] == 2 * 2 * 2  # steps x passes x mini-batches
    history = _history(tmp_path / "run")
    assert all(0 <= v <= 1 for _, v in history["train/clip_frac"])


def test_failing_reward_function_does_not_kill_the_run(quick_cfg, tmp_path):
    summary = train(
        quick_cfg(
            "task._target_=flaky_task.FlakyArithmetic",
            "rl.steps=4",
            "rl.prompts_per_step=16",
            "rl.prompts_per_minibatch=16",
            "rl.samples_per_prompt=8",
            "checkpoint_every=0",
            "sample_rows=-1",
        )
    )
    history = _history(tmp_path / "run")
    unscorable = [v for _, v in history["rollout/unscorable"]]
    assert sum(unscorable) > 0  # failures were counted ...
    assert all(math.isfinite(v) for _, v in history["train/loss"])  # ... and the loss never saw a NaN
    assert math.isfinite(summary["reward_last"])
    # held out: unscorable completions are counted, and left out of the accuracy rather than called wrong
    with open(tmp_path / "run" / "samples.csv") as f:
        rows = list(csv.DictReader(f))
    for step, accuracy in history["val/accuracy"]:
        verdicts = [r["correct"] for r in rows if int(r["step"]) == step]
        scored = [int(v) for v in verdicts if v != ""]
        assert dict(history["val/unscorable"])[step] == len(verdicts) - len(scored)
        assert accuracy == pytest.approx(sum(scored) / len(scored))
    assert sum(v for _, v in history["val/unscorable"]) > 0


def test_resume_from_checkpoint_continues_the_step_count(quick_cfg, tmp_path):
    train(quick_cfg(f"output_dir={tmp_path}/first", "rl.steps=2", "checkpoint_every=1"))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    summary = train(quick_cfg(f"output_dir={tmp_path}/second", "rl.steps=4", f"resume_from={ckpt}"))
    assert summary["rl_steps"] == 4 and summary["optimizer_steps"] == 4
    first, second = _history(tmp_path / "first"), _history(tmp_path / "second")
    assert [s for s, _ in second["rollout/reward"]] == [0, 1, 2, 3]  # the whole run, not its tail
    assert second["rollout/reward"][:2] == first["rollout/reward"]  # restored from the checkpoint


def test_cli_run_log_is_quiet_and_useful(model_cache, tmp_path):
    """`python src/train.py debug=quick` into a pipe (as under CI or nohup): the engine and decoding
    loop chosen, occasional progress lines, the validation numbers and the summary; no warnings, no
    redraws."""
    import os
    import subprocess
    import sys

    from loorl.config import CONF_DIR

    env = {**os.environ, "LOORL_CACHE": str(model_cache)}
    proc = subprocess.run(
        [sys.executable, "src/train.py", "debug=quick", "rollout=hf", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=CONF_DIR.parent, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "rollout engine: hf" in out and "held-out greedy accuracy" in out
    assert "key/value cache (rollout.hf_decode=auto: " in out  # which decoding loop, and why
    progress = [line for line in out.splitlines() if "val/accuracy" in line and "step " in line]
    assert len(progress) == 3, out  # before training, then every val_every=2 of the 4 steps
    noise = ("warn", "Tip", "Found ", "infer the", "deprecated", "GPU available", "\r", "Traceback")
    assert not [line for line in out.splitlines() if any(n in line for n in noise)], out
    assert (tmp_path / "run" / "csv" / "metrics.csv").exists()
