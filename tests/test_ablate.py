"""`scripts/research/ablate.py`: a real Hydra multirun (2 settings x 2 seeds, logged to csv and offline wandb)
turned into a table, a JSON record and curves; `--from` reads it again; the pure statistics by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from fixtures import installed, load_script, needs_wandb
from loorl.research.ablation import markdown_table, summarize
from loorl.research.ablation_plots import moving_average
from loorl.research.job_metrics import accuracy_auc, checkpoint_bytes, job_metrics, reach, reach_metrics
from loorl.research.jobs import Job, cost_before, cost_through, group_settings
from loorl.research.stats import mean_ci

ROOT = Path(__file__).resolve().parents[1]
ABLATE = [sys.executable, str(ROOT / "scripts" / "research" / "ablate.py")]
# the sweep logs to offline wandb too where wandb is installed (a GPU node may lack it)
LOGGERS = "logger=[csv,wandb]" if installed("wandb") else "logger=[csv]"


# ---- statistics by hand ------------------------------------------------------------------------
def test_mean_ci_by_hand():
    mean, half = mean_ci([1.0, 2.0, 3.0])  # sd 1, n 3: t(0.975, 2) = 4.3027 (tables)
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert mean_ci([5.0])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])  # one seed: no interval
    assert mean_ci([1.0, float("nan"), 3.0])[0] == 2.0  # a missing value is left out


def test_accuracy_auc_by_hand():
    assert accuracy_auc(np.array([0, 10, 20]), np.array([0.0, 0.5, 0.5])) == pytest.approx(7.5 / 20)
    assert accuracy_auc(np.array([20, 0, 10]), np.array([0.5, 0.0, 0.5])) == pytest.approx(7.5 / 20)


def test_moving_average_by_hand():
    values = np.array([[1.0, 3.0, 5.0, 7.0], [0.0, 0.0, 4.0, 4.0]])
    assert moving_average(values, 2).tolist() == [[1.0, 2.0, 4.0, 6.0], [0.0, 0.0, 2.0, 4.0]]
    assert moving_average(values, 1).tolist() == values.tolist()


def job(*overrides: str) -> Job:
    seed = next(int(o.split("=")[1]) for o in overrides if o.startswith("seed="))
    return Job(Path("."), list(overrides), seed, {}, {}, {})


def test_settings_are_the_overrides_that_differ_without_the_seed():
    jobs = [job("ablation=x", f"estimator={e}", f"seed={s}") for e in ("rloo", "grpo") for s in (0, 1)]
    settings = group_settings(jobs)
    assert [s.label for s in settings] == ["rloo", "grpo"]
    assert [[j.seed for j in s.jobs] for s in settings] == [[0, 1], [0, 1]]
    two_keys = [
        job(f"estimator={e}", f"loss.agg={a}", "seed=0") for e in ("rloo", "grpo") for a in ("t", "s")
    ]
    assert [s.label for s in group_settings(two_keys)][0] == "estimator=rloo, loss.agg=t"
    group = [job("+ablation/kl_settings=none", "seed=0"), job("+ablation/kl_settings=loss_k2", "seed=0")]
    assert [s.label for s in group_settings(group)] == ["none", "loss_k2"]


def test_a_cosmetic_override_is_not_a_setting_and_no_override_is_named():
    jobs = [job("experiment=x", "trainer.enable_progress_bar=false", "seed=0"),
            job("experiment=x", "trainer.enable_progress_bar=False", "arm=on", "seed=0")]  # fmt: skip
    assert [s.label for s in group_settings(jobs)] == ["(no override)", "on"]
    assert [s.label for s in group_settings(jobs[:1])] == ["(all runs)"]


def history_job(accuracy: list[tuple[int, float]], steps: int, *, tokens=100.0, seconds=2.0, **extra) -> Job:
    history = {
        "val/accuracy": accuracy,
        "rollout/gen_tokens": [(s, tokens) for s in range(steps)],
        "perf/step_seconds": [(s, seconds) for s in range(steps)],
        **extra,
    }
    return Job(Path("."), ["seed=0"], 0, {}, history, {"rl": {"prompts_per_step": 16}})


def test_reaching_a_level_by_hand():
    run = history_job([(0, 0.3), (5, np.float32(0.7).item()), (10, 0.69), (15, 0.8)], steps=15)
    # 70% first at step 5 (a float32 0.7 is 0.699999988): the rollouts 0..4 before it, 5 x 100 tokens, 5 x 2 s
    assert reach(run, 0.70) == {"step": 5.0, "tokens": 500.0, "seconds": 10.0}
    assert reach(run, 0.80) == {"step": 15.0, "tokens": 1500.0, "seconds": 30.0}
    assert all(math.isnan(v) for v in reach(run, 0.90).values())
    assert reach(history_job([(0, 0.75)], steps=3), 0.70) == {"step": 0.0, "tokens": 0.0, "seconds": 0.0}


def test_costs_before_a_validation_and_through_a_rollout():
    cumulative = np.array([10.0, 30.0, 60.0])  # rollouts 0, 1, 2
    # validation at step s saw the policy after s updates: rollouts 0..s-1; the reward of step s: 0..s
    assert [cost_before(cumulative, s) for s in (0, 1, 3, 9)] == [0.0, 10.0, 60.0, 60.0]
    assert [cost_through(cumulative, s) for s in (0, 1, 2, 9)] == [10.0, 30.0, 60.0, 60.0]
    assert math.isnan(cost_before(np.array([]), 4))


def test_groups_with_signal_per_step_with_and_without_dynamic_sampling():
    plain = history_job([(0, 0.3)], steps=2, **{"rollout/zero_std_group_frac": [(0, 0.75), (1, 0.5)]})
    assert reach_metrics(plain)["signal_groups"] == (4 + 8) / 2 and math.isnan(reach_metrics(plain)["rounds"])
    dynamic = history_job([(0, 0.3)], steps=2, **{"rollout/zero_std_group_frac": [(0, 0.75), (1, 0.5)],
                                                  "dynamic/rounds": [(0, 3.0), (1, 2.0)],
                                                  "dynamic/groups_with_signal": [(0, 10.0), (1, 16.0)]})  # noqa: E501  # fmt: skip
    assert reach_metrics(dynamic)["signal_groups"] == 13.0 and reach_metrics(dynamic)["rounds"] == 2.5


def test_the_tool_use_columns_show_first_and_last_and_only_where_a_run_used_tools():
    from loorl.research.jobs import Setting

    tools = history_job([(0, 0.3), (10, 0.9)], steps=10, **{"val/tool_used_frac": [(10, 1.0), (0, 0.5)]})
    control = history_job([(0, 0.1), (10, 0.2)], steps=10)
    metrics = job_metrics(tools)
    assert metrics["first_accuracy"] == 0.3
    assert (metrics["first_tool_use"], metrics["final_tool_use"]) == (0.5, 1.0)
    assert math.isnan(job_metrics(control)["first_tool_use"])
    table = markdown_table(summarize([Setting("1", [tools]), Setting("0", [control])]), title="t")
    assert "| first acc. (%) | final acc. (%) | best acc. (%) | acc. AUC (%) | tool use first (%) |" in table
    assert "| 1 | 1 | 30.0 | 90.0 | 90.0 | 60.0 | 50.0 | 100.0 |" in table
    assert "| 0 | 1 | 10.0 | 20.0 | 20.0 | 15.0 | n/a | n/a |" in table
    assert "tool use" not in markdown_table(summarize([Setting("0", [control])]), title="t")


def test_the_reach_table_counts_the_seeds_that_got_there():
    from loorl.research.jobs import Setting

    slow = history_job([(0, 0.3), (10, 0.75)], steps=10)
    fast = history_job([(0, 0.3), (5, 0.71), (10, 0.85)], steps=10)
    fast.seed = 1
    rows = summarize([Setting("arm", [slow, fast])])
    assert rows[0]["reach"]["step_to_70"]["values"] == [10.0, 5.0]
    assert rows[0]["reach"]["step_to_80"]["reached"] == 1
    table = markdown_table(rows, title="t")
    assert "| steps to 70% | gen. tokens to 70% | RL-step s to 70% | steps to 80% |" in table
    assert "| arm | 7.5 ± 31.8 | 750 ± 3,177 | 15 ± 64 | 10.0 (1 of 2 seeds) |" in table


def test_checkpoint_size_of_a_file_or_a_folder_of_shards(tmp_path):
    (tmp_path / "one.ckpt").write_bytes(b"x" * 1000)
    shards = tmp_path / "fsdp.ckpt"
    (shards / "inner").mkdir(parents=True)
    (shards / "a.distcp").write_bytes(b"x" * 300)
    (shards / "inner" / "meta").write_bytes(b"x" * 200)
    assert checkpoint_bytes(tmp_path / "one.ckpt") == 1000 and checkpoint_bytes(shards) == 500
    assert math.isnan(checkpoint_bytes(tmp_path / "none.ckpt"))


# ---- a real sweep --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sweep(model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation") / "estimators"
    command = ABLATE + ["estimators", "--seeds", "2", "--steps", "2", "--out", str(out),
                        "estimator=rloo,reinforce", "debug=quick", "rollout=hf",
                        f"model.cache_dir={model_cache}", "val_every=1", "val_pass_k=0", LOGGERS,
                        "trainer.enable_progress_bar=false"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def test_the_sweep_runs_every_setting_and_seed(sweep):
    out, stdout = sweep
    jobs = sorted(p for p in (out / "runs").iterdir() if p.is_dir() and (p / "metrics.json").is_file())
    assert len(jobs) == 4
    assert "| rloo | 2 |" in stdout and "| reinforce | 2 |" in stdout


def test_the_table_is_the_mean_and_interval_of_the_runs(sweep):
    out, _ = sweep
    rows = {r["setting"]: r for r in json.loads((out / "table.json").read_text())}
    assert set(rows) == {"rloo", "reinforce"}
    for setting, row in rows.items():
        assert row["seeds"] == [0, 1]
        finals, folders = [], []
        for folder in sorted(p for p in (out / "runs").iterdir() if p.is_dir()):
            if f"estimator={setting}" in yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text()):
                history = json.loads((folder / "metrics.json").read_text())["history"]
                finals.append(history["val/accuracy"][-1][1])
                folders.append(folder)
        final = row["metrics"]["final_accuracy"]
        assert sorted(final["values"]) == pytest.approx(sorted(finals))
        assert final["mean"] == pytest.approx(np.mean(finals))
        assert row["metrics"]["gen_tokens"]["mean"] > 0 and row["metrics"]["wall_seconds"]["mean"] > 0
        assert 0 < row["metrics"]["step_seconds"]["mean"] < row["metrics"]["wall_seconds"]["mean"]
        assert row["metrics"]["peak_host_gib"]["mean"] > 0.2  # torch alone is resident at a few hundred MB
        sizes = [checkpoint_bytes(f / "checkpoints" / "last.ckpt") / 1e6 for f in folders]
        assert sorted(row["metrics"]["checkpoint_mb"]["values"]) == pytest.approx(sorted(sizes), nan_ok=True)
    table = (out / "table.md").read_text()
    assert "| setting | seeds | first acc. (%) | final acc. (%) |" in table and "±" in table
    assert "| s/step | peak RSS (GiB) | checkpoint (MB) |" in table
    assert "| setting | steps to 70% |" in table and all(
        r["reach"]["rounds"]["reached"] == 0 for r in rows.values()
    )
    assert (out / "curves.png").stat().st_size > 10_000


def test_from_reads_the_runs_again_and_a_second_sweep_does_not_overwrite(sweep, tmp_path, capsys):
    out, _ = sweep
    ablate = load_script("research/ablate.py")  # its main here: the same code, no interpreter start
    assert ablate.main(["--from", str(out / "runs"), "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "table.json").read_text()) == json.loads((out / "table.json").read_text())
    assert ablate.main(["estimators", "--out", str(out)]) == 2
    assert "exists (an earlier ablation)" in capsys.readouterr().out


@needs_wandb
def test_the_sweep_is_one_wandb_group_of_offline_runs(sweep):
    from wandb_records import run_info

    out, _ = sweep
    runs = sorted((out / "runs").glob("*/wandb/offline-run-*"))
    assert len(runs) == 4  # one per job: each job finishes its wandb run
    infos = [run_info(r) for r in runs]
    assert {i["group"] for i in infos} == {str(out / "runs")}
    assert len({i["name"] for i in infos}) == 4 and all("seed=" in i["name"] for i in infos)
    for info in infos:
        assert {"val/accuracy", "rollout/reward", "train/loss_epoch"} <= set(info["history"])
        assert json.loads(info["config"]["estimator"])["name"] in ("rloo", "reinforce")  # the resolved config
        assert any(f.startswith("media/table/samples") for f in info["files"])  # the samples table
    listed = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run", str(runs[0])],  # this interpreter's wandb,
        capture_output=True,
        text=True,
        timeout=120,  # not PATH's (an unactivated venv has none on PATH)
    )
    assert "Would sync 1 run(s)" in listed.stdout + listed.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["nope"], "unknown ablation 'nope'"), (["estimators", "--seeds", "0"], "--seeds must be at least 1"),
     (["--from", "/no/such/dir"], "--from /no/such/dir: no such folder"), ([], "name an ablation")],
)  # fmt: skip
def test_bad_arguments_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script("research/ablate.py").main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_command_exits_2_with_one_line():
    done = subprocess.run(ABLATE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith("or pass --from DIR")


@pytest.mark.slow  # the bundles' composition is tests/test_configs.py's; the sweep itself is the one above
def test_the_kl_ablation_sweeps_its_setting_bundles(model_cache, tmp_path):
    """A sweep over a config group (`+ablation/kl_settings`), run for real: every bundle is a setting,
    and only those with a reference model have a KL."""
    out = tmp_path / "kl"
    command = ABLATE + ["kl", "--seeds", "1", "--steps", "1", "--out", str(out), "debug=quick", "rollout=hf",
                        f"model.cache_dir={model_cache}", "val_pass_k=0",
                        "trainer.enable_progress_bar=false"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["setting"]: r["metrics"]["kl"]["mean"] for r in json.loads((out / "table.json").read_text())}
    assert list(rows) == ["none", "reward_k1", "loss_k2", "loss_k3"]
    assert math.isnan(rows["none"])
    assert all(math.isfinite(rows[s]) for s in ("reward_k1", "loss_k2", "loss_k3"))
