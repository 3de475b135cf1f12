"""`src/eval.py` and the validation it shares: an exported policy and a checkpoint evaluate to what
the run's own last validation measured; samples.csv; bad input is one line."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import needs
from loorl.cli.evaluate import evaluate
from loorl.cli.train import train
from loorl.config import compose_config
from loorl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(quick_config, tmp_path_factory):
    """A quick run (validations at steps 0, 2, 4) with its exported policy and last.ckpt."""
    run = tmp_path_factory.mktemp("trained") / "run"
    summary = train(quick_config("val_pass_k=2", "sample_rows=3", output_dir=run))
    return run, summary


def eval_config(model_cache, out, *overrides):
    quick = ["debug=quick", "rollout=hf", f"model.cache_dir={model_cache}"]
    quick += ["trainer.enable_progress_bar=false"]
    return compose_config(f"output_dir={out}", *quick, *overrides, config_name="eval")


def test_samples_csv_holds_each_validation_once(trained):
    run, _ = trained
    with (run / "samples.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "prompt", "completion", "reward", "correct"]
    assert [int(r["step"]) for r in rows] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    prompts = [r["prompt"] for r in rows]
    assert prompts[:3] == prompts[3:6] == prompts[6:]  # the same held-out prompts, step after step
    for r in rows:  # the arithmetic verifier: reward 1 exactly where correct
        assert float(r["reward"]) == float(r["correct"])
        assert r["prompt"].endswith("=")


def test_eval_of_the_exported_policy_matches_the_last_validation(trained, model_cache, tmp_path):
    run, summary = trained
    results = evaluate(eval_config(model_cache, tmp_path / "hf", f"policy={run}/policy"))
    metrics = results["metrics"]
    assert metrics["pass@1_greedy"] == pytest.approx(summary["val_accuracy_end"], abs=1e-6)  # same weights
    assert results["num_prompts"] == 200 and results["eval"] == {
        "split": "eval",
        "samples": 8,
        "k": 4,
        "seed": 0,
    }
    assert 0.0 <= metrics["pass@1_greedy"] <= metrics["pass@4"] <= 1.0
    assert 0.0 <= metrics["maj@4"] <= 1.0
    assert metrics["reward"] == pytest.approx(metrics["pass@1_greedy"])  # reward 1 exactly when correct
    written = json.loads((tmp_path / "hf" / "results.json").read_text())
    assert written["metrics"] == metrics
    assert "| greedy pass@1 |" in (tmp_path / "hf" / "results.md").read_text()
    with (tmp_path / "hf" / "samples.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 200  # eval.rows=-1: every prompt's greedy completion
    assert sum(int(r["correct"]) for r in rows) / 200 == pytest.approx(metrics["pass@1_greedy"])


def test_eval_of_the_checkpoint_matches_the_exported_policy(trained, model_cache, tmp_path):
    run, summary = trained
    ckpt = run / "checkpoints" / "last.ckpt"
    results = evaluate(eval_config(model_cache, tmp_path / "ckpt", f"policy={ckpt}", "eval.samples=0"))
    assert results["metrics"]["pass@1_greedy"] == pytest.approx(summary["val_accuracy_end"], abs=1e-6)
    assert set(results["metrics"]) == {"pass@1_greedy", "reward", "unscorable"}  # samples=0: greedy only
    assert results["metrics"]["unscorable"] == 0 and results["facts"] == {}  # arithmetic: no sandbox


@needs("lm_eval", what="lm-eval (.[lm-eval], part of .[test])")
def test_lm_eval_of_the_checkpoint_matches_loorls_own(trained, model_cache, tmp_path):
    """A checkpoint goes to lm-eval as a temporary HF folder, removed afterwards; lm-eval's exact match on
    the held-out sums (examples/lm_eval) is loorl's greedy pass@1 and the run's last validation."""
    run, summary = trained
    overrides = (f"policy={run}/checkpoints/last.ckpt", "eval.samples=0", "lm_eval.tasks=[loorl_arithmetic]",
                 f"lm_eval.include_path={ROOT}/examples/lm_eval", "lm_eval.log_samples=false")  # fmt: skip
    results = evaluate(eval_config(model_cache, tmp_path, *overrides))
    exact = results["lm_eval"]["results"]["loorl_arithmetic"]["exact_match,none"]
    assert exact == pytest.approx(results["metrics"]["pass@1_greedy"], abs=1e-6)  # float32
    assert exact == pytest.approx(summary["val_accuracy_end"], abs=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "lm_eval_results.json", "results.json", "results.md", "samples.csv"]  # fmt: skip


def test_eval_on_drawn_training_prompts(trained, model_cache, tmp_path):
    run, _ = trained
    overrides = (
        f"policy={run}/policy",
        "eval.split=train",
        "eval.num_prompts=16",
        "eval.samples=4",
        "eval.k=2",
    )
    results = evaluate(eval_config(model_cache, tmp_path / "train", *overrides))
    assert results["num_prompts"] == 16 and set(results["metrics"]) == {
        "pass@1_greedy",
        "reward",
        "unscorable",
        "pass@2",
        "maj@2",
    }


def test_eval_refuses_a_checkpoint_of_another_model(trained, model_cache, tmp_path):
    run, _ = trained
    cfg = eval_config(
        model_cache, tmp_path, f"policy={run}/checkpoints/last.ckpt", "model.tiny.hidden_size=64"
    )
    with pytest.raises(ConfigError, match="was trained from model .* pass the model=/task= options"):
        evaluate(cfg)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("/no/such/policy", "policy=/no/such/policy does not exist"),
        ("FOLDER", "is a folder without config.json"),
    ],
)
def test_eval_refuses_a_bad_policy_path(model_cache, tmp_path, policy, message):
    policy = str(tmp_path) if policy == "FOLDER" else policy
    with pytest.raises(ConfigError, match=message):
        evaluate(eval_config(model_cache, tmp_path / "out", f"policy={policy}"))


def test_eval_cli_prints_the_table_and_one_line_errors(trained, model_cache, tmp_path):
    run, summary = trained
    command = [sys.executable, str(ROOT / "src" / "eval.py"), f"policy={run}/policy", "debug=quick",
               "rollout=hf", f"model.cache_dir={model_cache}", f"hydra.run.dir={tmp_path / 'cli'}",
               "eval.samples=2", "eval.k=2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "| greedy pass@1 |" in done.stdout and "| pass@2 (unbiased, n=2) |" in done.stdout
    assert json.loads((tmp_path / "cli" / "results.json").read_text())["metrics"][
        "pass@1_greedy"
    ] == pytest.approx(summary["val_accuracy_end"], abs=1e-6)
    # a bad setting is one line before Lightning loads (`-X importtime` lists what the command imported)
    bad = [command[0], "-X", "importtime", *command[1:3], "eval.k=3", "eval.samples=2"]
    bad = subprocess.run([*bad, f"hydra.run.dir={tmp_path}/bad"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stdout.strip().splitlines()[-1].startswith("error: eval.k=3 is more than eval.samples=2")
    lines = [line for line in bad.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[1].strip() for line in lines}
    assert "loorl.cli.evaluate" in imported and "lightning" not in imported


def test_the_results_table_shows_each_held_out_set_and_keeps_further_levels_out_of_pass_at_1():
    """task.eval_levels' held-out sets (`<name>@L<level>`) are outside pass@1 (val/accuracy covers the
    starting level only): the table counts them apart and gives every set its own row."""
    from loorl.cli.evaluate import markdown

    results = {
        "policy": "/runs/a/policy", "model": "smollm2", "task": "reasoning_gym", "seconds": 1.0,
        "num_prompts": 50, "extra_prompts": 100,
        "per_source": {"chain_sum": 0.56, "chain_sum@L1": 0.16, "chain_sum@L2": 0.04},
        "eval": {"split": "eval", "samples": 0, "k": 4, "seed": 0},
        "metrics": {"pass@1_greedy": 0.56, "reward": 0.56, "unscorable": 0.0},
    }  # fmt: skip
    text = markdown(results)
    assert (
        "| task (split, prompts) | reasoning_gym (eval, 50; 100 more at task.eval_levels, outside pass@1"
        in text
    )
    assert "| greedy pass@1 | 56.0% |" in text and "| greedy pass@1, chain_sum@L1 | 16.0% |" in text
    plain = markdown(results | {"extra_prompts": 0, "per_source": {}})  # a task of one source, as before
    assert "| task (split, prompts) | reasoning_gym (eval, 50) |" in plain and "pass@1, " not in plain
