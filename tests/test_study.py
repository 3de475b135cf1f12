"""The study tooling (scripts/research/study.py, loorl.research.study*): study files, the
config-difference check, a real study resumed, its report and its records. The studies loorl ships and
their published reports are tests/test_published_studies.py's; the statistics and the pairing check by
hand are tests/test_study_statistics.py's."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fixtures import load_script
from loorl.config import ConfigError
from loorl.research import study as study_module
from loorl.research.study import load_study
from loorl.research.study_configs import LATER_KEYS, check_part, config_digest, differences, resolved
from loorl.research.study_records import keep_record, record_bytes

ROOT = Path(__file__).resolve().parents[1]
STUDY = [sys.executable, str(ROOT / "scripts" / "research" / "study.py")]


# ---- the study file and its configs -------------------------------------------------------------------
def write_study(tmp_path, monkeypatch, parts: dict) -> str:
    monkeypatch.setattr(study_module, "STUDY_DIR", tmp_path)
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({"title": "mine", "parts": parts}, sort_keys=False))
    return "mine"


def test_a_difference_the_part_does_not_name_stops_the_study(tmp_path, monkeypatch):
    name = write_study(tmp_path, monkeypatch, {"p": {
        "overrides": ["debug=quick"], "seeds": 2, "may_differ": ["estimator"],
        "settings": {"rloo": ["estimator=rloo"], "grpo": ["estimator=grpo", "optimizer.lr=0.001"]},
    }})  # fmt: skip
    lines = []
    with pytest.raises(ConfigError, match=r"'grpo' also changes optimizer.lr \(.* -> 0.001\)"):
        check_part(load_study(name).parts[0], echo=lines.append)
    assert "estimator.name: rloo -> grpo" in lines[-1] and "optimizer.lr" in lines[-1]  # printed first


def test_a_key_may_move_with_the_seed_only_to_the_seeds_value(tmp_path, monkeypatch):
    name = write_study(tmp_path, monkeypatch, {"p": {
        "overrides": ["debug=quick", "model.tiny.warm_start.seed=${seed}"], "seeds": 2, "may_differ": [],
        "settings": {"a": []},
    }})  # fmt: skip
    check_part(load_study(name).parts[0], echo=lambda _: None)  # each seed its own warm start: fine
    name = write_study(tmp_path, monkeypatch, {"p": {
        "overrides": ["debug=quick", "task.name=run${seed}"], "seeds": 2, "may_differ": [],
        "settings": {"a": []},
    }})  # fmt: skip
    with pytest.raises(ConfigError, match=r"task.name changes with the seed \(run0 -> run1\)"):
        check_part(load_study(name).parts[0], echo=lambda _: None)


def test_the_command_lines_overrides_reach_every_setting_and_its_runs_folder():
    plain, steps1 = (
        load_study("quick", only=["estimators"], extra=extra).parts[0] for extra in ([], ["rl.steps=1"])
    )
    for part in (plain, steps1):
        check_part(part, echo=lambda _: None)
    for a, b in zip(plain.settings, steps1.settings):
        assert b.overrides == a.overrides + ["rl.steps=1"]  # last: it wins over the part's rl.steps=2
        assert (a.steps, b.steps) == (2, 1) and a.digest != b.digest


@pytest.mark.parametrize(
    "parts, message",
    [
        ({}, "has no parts"),
        ({"p": {"settings": {}}}, "no settings"),
        ({"p": {"settings": {"a": []}, "seed": 3}}, "unknown key 'seed'"),
        ({"p": {"settings": {"a": []}, "reference": "b"}}, "compares 'b', which is not one of its settings"),
        ({"p": {"settings": {"a": []}, "kind": "sweep"}}, "kind='sweep': choose train or probe"),
        ({"p": {"settings": {"a": []}, "kind": "probe"}}, "every is required"),
        ({"p": {"settings": {"a": []}, "seeds": 0}}, "seeds=0: at least 1"),
        (
            {"p": {"settings": {"a": []}, "pairing": "levels"}},
            r"pairing='levels': choose prompts .* or seeds",
        ),
        ({"p": {"settings": {"a": []}, "metrics": ["best"]}}, "metrics has 'best': each is final or auc"),
        ({"p": {"settings": {"a": []}, "metrics": ["final/"]}}, "metrics has 'final/'"),
        (
            {"p": {"settings": {"a": []}, "kind": "probe", "probe": {"every": 1, "args": ["--samples", 1]}}},
            r"probe.args: --samples must be at least 2",
        ),
        (
            {"p": {"settings": {"a": []}, "kind": "probe", "probe": {"every": 1, "args": ["--nope", 1]}}},
            r"probe.args \['--nope', '1'\] should be pairs such as \[--prompts, 32\]; the options: --prompts",
        ),
    ],
)
def test_bad_study_files_are_one_line(tmp_path, monkeypatch, parts, message):
    name = write_study(tmp_path, monkeypatch, parts)
    with pytest.raises(ConfigError, match=message) as error:
        load_study(name)
    assert "\n" not in str(error.value)


def test_an_unknown_study_or_part_names_the_choices():
    with pytest.raises(ConfigError, match="choose one of .*which_estimator"):
        load_study("which_estimators")
    with pytest.raises(ConfigError, match="no such part of which_estimator; its parts: estimators"):
        load_study("which_estimator", only=["estimator"])


def test_the_level_table_and_the_per_level_comparison_by_hand(tmp_path, monkeypatch):
    from loorl.research.jobs import Job
    from loorl.research.study_tables import comparison_table, level_table, metric_title

    name = write_study(tmp_path, monkeypatch, {"p": {
        "settings": {"cur": [], "fixed": []}, "seeds": 2, "pairing": "seeds", "reference": "fixed",
        "metrics": ["final", "final/chain_sum@L1"]}, "q": {"settings": {"a": []}}})  # fmt: skip
    part, plain = load_study(name).parts
    assert (part.pairing, part.metrics) == ("seeds", ["final", "final/chain_sum@L1"])
    assert (plain.pairing, plain.metrics) == ("prompts", ["final", "auc"])  # the defaults

    def job(levels):  # levels logged at steps 0, 1, ... (shuffled: the table sorts by step)
        history = {"curriculum/level/chain_sum": [(i, v) for i, v in enumerate(levels)][::-1]}
        return Job(tmp_path, [], 0, {}, history, {})

    jobs = {"cur": {0: job([0, 0, 1, 1, 2]), 1: job([0, 1, 1, 1, 1])}, "fixed": {0: job([1, 1]), 1: job([0])}}
    rows = [
        line for line in level_table(part, jobs) if line.startswith("| cur") or line.startswith("| fixed")
    ]
    assert rows == [
        "| cur | 0 | chain_sum | L0 | L2 | L1 at step 2, L2 at step 4 |",
        "| cur | 1 | chain_sum | L0 | L1 | L1 at step 1 |",
        "| fixed | 0 | chain_sum | L1 | L1 | never moved |",
        "| fixed | 1 | chain_sum | L0 | L0 | never moved |",
    ]
    assert level_table(part, {"cur": {0: Job(tmp_path, [], 0, {}, {}, {})}, "fixed": {}}) == []
    still = {"cur": {0: job([0, 0]), 1: job([0])}, "fixed": {0: job([1, 1]), 1: job([1])}}
    assert level_table(part, still) == [  # no run moved: one line, not a row per run saying so
        "Training levels (`curriculum/level/<dataset>`): fixed in every run: chain_sum L0/L1."
    ]

    # cur - fixed per seed: final [0.5, 0.7] - [0.4, 0.4] = [0.1, 0.3]; at L1 [0.2, 0.2] - [0.1, 0.3]
    data = {"cur": {"final": [0.5, 0.7], "final/chain_sum@L1": [0.2, 0.2]},
            "fixed": {"final": [0.4, 0.4], "final/chain_sum@L1": [0.1, 0.3]}}  # fmt: skip
    lines, records = comparison_table(part, data)
    assert [(r["metric"], round(r["mean"], 6)) for r in records] == [
        ("final acc.", 0.2),
        ("final chain_sum@L1", 0.0),
    ]
    assert "| cur - fixed | final chain_sum@L1 | +0.0 |" in "\n".join(lines)
    assert "its starting policy and its RL seed; the problems differ by design" in lines[-1]
    assert metric_title("auc/spell_backward@L2") == "AUC spell_backward@L2"


def test_the_dynamics_table_by_hand(tmp_path, monkeypatch):
    from loorl.research.jobs import Job
    from loorl.research.study_tables import dynamics_table, window_mean

    name = write_study(tmp_path, monkeypatch, {"p": {"settings": {"a": [], "b": []}, "seeds": 2}})
    part = load_study(name).parts[0]

    def job(entropy, spread):  # six steps, 0..5: the last third is steps 4-5, after the first third 2-5
        history = {
            "train/entropy": list(enumerate(entropy)),
            "rollout/zero_std_group_frac": list(enumerate(spread)),
        }
        return Job(tmp_path, [], 0, {}, history, {})

    a0 = job([1, 1, 1, 1, 0.1, 0.3], [0, 0, 0.5, 0.5, 1, 1])  # entropy (0.1 + 0.3) / 2, spread 0.75
    a1 = job([1, 1, 1, 1, 0.2, 0.2], [0, 0, 1, 1, 1, 1])  # 0.2 and 1.0
    assert window_mean(a0.history, "train/entropy", from_share=2 / 3) == pytest.approx(0.2)
    assert math.isnan(window_mean(a0.history, "never logged", from_share=0.5))
    lines, data = dynamics_table(part, {"a": {0: a0, 1: a1}, "b": {0: job([1] * 6, [0.25] * 6)}})
    assert data["a"]["rollout/zero_std_group_frac"] == pytest.approx([0.75, 1.0])
    # a: entropy 0.2 ± 0 (both seeds 0.2); spread 87.5 ± t(0.975, 1) sd(0.75, 1.0) / sqrt(2) = 158.8 points
    assert "| a | 2 | 0.200 ± 0.000 | 87.5 ± 158.8 |" in lines
    assert "| b | 1 | 1.000 | 25.0 |" in lines  # one seed: no interval


# ---- a real study, resumed -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_study(model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    # overrides for every run, checked to arrive: rl.steps=1 wins over the file's rl.steps=2
    command = STUDY + ["quick", "--out", str(out / "runs"), "--report-dir", str(out / "report"),
                       f"model.cache_dir={model_cache}", "rl.steps=1"]  # fmt: skip
    # the default suite runs the estimators part; the probe part's test (slow) runs both
    done = subprocess.run(
        command + ["--only", "estimators"], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, command, done.stdout


def test_the_study_runs_every_setting_and_seed_paired(quick_study, model_cache):
    out, _, stdout = quick_study
    assert "[estimators] 0 runs finished before, 4 to run" in stdout
    runs = sorted((out / "runs" / "runs").glob("*/seed*/metrics.json"))
    runs = [r for r in runs if not r.parent.parent.name.endswith("-checkpoints")]  # the probe's own run
    assert len(runs) == 4
    digests = {}
    for metrics in runs:
        setting = json.loads((metrics.parent.parent / "setting.json").read_text())["label"]
        history = json.loads(metrics.read_text())["history"]
        digests[setting, metrics.parent.name] = history["rollout/prompt_digest"]
        assert "rollout/completion_len_wrong" in history or "rollout/completion_len_correct" in history
    assert digests["rloo", "seed0"] == digests["grpo", "seed0"] != digests["rloo", "seed1"]
    for metrics in runs:  # the command line's overrides reached every run's resolved config
        config = yaml.safe_load((metrics.parent / "config.yaml").read_text())
        assert config["rl"]["steps"] == 1 and config["model"]["cache_dir"] == str(model_cache)
        assert json.loads(metrics.read_text())["summary"]["rl_steps"] == 1
    # checkpoint_every=0 keeps no checkpoint (Lightning's own ModelCheckpoint wrote one at every step)
    assert not [p for r in runs for p in r.parent.rglob("*.ckpt")]


def test_the_report_is_written_from_the_runs(quick_study):
    out, _, _ = quick_study
    report = out / "report"
    text = (report / "estimators.md").read_text()
    assert "| rloo | 2 |" in text and "| grpo - rloo | final acc. |" in text
    assert (
        "differ from rloo's in these keys only (checked before the runs):\n\n"
        "- grpo: estimator.name: rloo -> grpo\n" in text
    )
    assert "Seeds paired: 2 setting(s) with 8 prompts per step" in text
    from loorl.util.hardware import machine_line

    assert f"of compute (the runs' wall time; made on {machine_line()})." in text  # each run kept it
    data = json.loads((report / "estimators.json").read_text())
    finals = data["settings"]["rloo"]["final"]
    assert len(finals) == 2 and all(0 <= v <= 1 for v in finals)
    assert (
        "**RLOO and GRPO on the quick profile**, by held-out accuracy AUC"
        in (report / "headline.md").read_text()
    )
    for png in ("estimators_accuracy.png", "estimators_length.png", "estimators_dynamics.png"):
        assert (report / png).stat().st_size > 10_000
    assert "![dynamics](report/estimators_dynamics.png)" in text  # entropy, spread, gradient norm


@pytest.mark.slow  # a run with checkpoints and two probes, about 40 s more
def test_the_probe_part_probes_the_policy_before_rl_and_at_each_checkpoint(quick_study):
    out, command, _ = quick_study
    command = [a for a in command if a != "rl.steps=1"] + ["rl.steps=2"]  # checkpoints every 2 steps
    done = subprocess.run(command + ["--only", "estimators", "variance"], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stdout = done.stdout
    assert "[estimators] 0 runs finished before, 4 to run" in stdout  # other overrides: other runs
    assert "[variance] probe at step 0:" in stdout and "--policy" in stdout.split("probe at step 2:")[1]
    for step in (0, 2):
        results = json.loads(
            (out / "runs" / "probe" / "variance" / f"step{step}" / "results.json").read_text()
        )
        assert {r["estimator"] for r in results["rows"]} >= {"rloo", "grpo", "reinforce", "batch_mean"}
    table = (out / "report" / "variance.md").read_text()
    assert "| estimator | step 0 | step 2 | step 0, rewards + 1 | acc. AUC (estimators) |" in table
    rloo = next(line for line in table.splitlines() if line.startswith("| rloo |"))
    assert "n/a" not in rloo.split("|")[-3]  # the estimators part's AUC beside it


def test_a_rerun_runs_only_what_is_missing(quick_study, capsys):
    out, command, _ = quick_study
    lost = next(  # one of the fixture's own runs (the slow probe test adds rl.steps=2 runs beside them)
        p
        for p in sorted((out / "runs" / "runs").glob("*/seed1/metrics.json"))
        if "-" not in p.parts[-3]
        and yaml.safe_load((p.parent / "config.yaml").read_text())["rl"]["steps"] == 1
    )
    stopped = json.loads(lost.read_text())
    stopped["summary"]["rl_steps"] = 0  # as a run stopped before its one step writes it
    lost.write_text(json.dumps(stopped))
    (out / "report" / "runs" / lost.parts[-3] / "seed1.json.gz").unlink()  # and never recorded
    label = json.loads((lost.parent.parent / "setting.json").read_text())["label"]
    other = {"rloo": "grpo", "grpo": "rloo"}[label]
    study = load_script("research/study.py")  # its main here (its runs are processes of their own)
    assert study.main([*command[2:], "--only", "estimators", "--settings", other]) == 0
    assert "[estimators] 2 runs finished before, 0 to run" in capsys.readouterr().out  # the other's only
    assert json.loads(lost.read_text())["summary"]["rl_steps"] == 0
    assert study.main([*command[2:], "--only", "estimators"]) == 0
    assert "[estimators] 3 runs finished before, 1 to run" in capsys.readouterr().out
    assert json.loads(lost.read_text())["summary"]["rl_steps"] == 1


def test_a_fresh_clone_writes_the_same_report_from_the_records_alone(quick_study, tmp_path, capsys):
    out, command, _ = quick_study
    report = out / "report"
    records = sorted((report / "runs").glob("*/seed*.json.gz"))
    runs = {f"{p.parts[-3]}/{p.parts[-2]}" for p in (out / "runs" / "runs").glob("*/seed*/metrics.json")}
    trained = {r for r in runs if "-" not in r.split("/")[0]}  # the probe part's own run has no record
    assert {f"{r.parent.name}/{r.name.removesuffix('.json.gz')}" for r in records} >= trained
    assert all(r.stat().st_size < 100_000 for r in records)
    folder = out / "runs" / "runs" / records[0].parent.name / records[0].name.removesuffix(".json.gz")
    assert keep_record(folder, records[0]) is False  # the same run, the same bytes
    clone = tmp_path / "clone" / "report"  # the same folder name: the page's image links are its name
    clone.mkdir(parents=True)
    for path in report.rglob("*.json.gz"):
        target = clone / path.relative_to(report)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    study = load_script("research/study.py")
    args = list(command[2:])
    args[args.index("--out") + 1] = str(tmp_path / "no-runs")
    args[args.index("--report-dir") + 1] = str(clone)
    assert study.main([*args, "--only", "estimators"]) == 0  # not --report: it would run what is missing
    assert "[estimators] 4 runs finished before, 0 to run" in capsys.readouterr().out
    assert not (tmp_path / "no-runs" / "runs").exists()
    assert (clone / "estimators.md").read_text() == (report / "estimators.md").read_text()
    assert json.loads((clone / "estimators.json").read_text()) == json.loads(
        (report / "estimators.json").read_text()
    )


def test_records_made_with_another_config_are_named_before_any_run(quick_study, tmp_path, capsys):
    """A record of a setting's overrides under another digest (its config resolved elsewhere: bf16 on a
    CPU with bf16 units, float32 on one without) is named before any run, with the keys that differ:
    runs here would not add seeds to it. The records this machine resolves to are not named."""
    out, command, stdout = quick_study
    assert "recorded with another config" not in stdout
    record = sorted((out / "report" / "runs").glob("*/seed0.json.gz"))[0]
    label = json.loads((out / "runs" / "runs" / record.parent.name / "setting.json").read_text())["label"]
    data = json.loads(gzip.decompress(record.read_bytes()))
    dtype = data["config"]["model"]["dtype"]
    data["config"]["model"]["dtype"] = "float16"  # as if resolved on another machine
    moved = tmp_path / "report" / "runs" / "0123456789" / "seed0.json.gz"
    moved.parent.mkdir(parents=True)
    moved.write_bytes(gzip.compress(json.dumps(data).encode()))
    args = list(command[2:])
    args[args.index("--report-dir") + 1] = str(tmp_path / "report")
    assert load_script("research/study.py").main([*args, "--only", "estimators", "--plan"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "recorded with another config" in line]
    assert said == [
        f"[estimators] {label}: recorded with another config than this machine resolves (model.dtype: "
        f"float16 -> {dtype}): runs here are new runs, not more seeds of the recorded ones"
    ]
    here = tmp_path / "report" / "runs" / record.parent.name / "seed0.json.gz"  # records of both machines
    here.parent.mkdir()
    here.write_bytes(record.read_bytes())
    assert load_script("research/study.py").main([*args, "--only", "estimators", "--plan"]) == 0
    assert "recorded with another config" not in capsys.readouterr().out  # this machine's are there too


def test_a_run_from_before_runs_kept_their_facts_gives_the_record_it_gave_then(tmp_path):
    """A record holds `facts` only where the run's metrics.json has them: the records made before (the
    published ones) keep their bytes when a report writes them again from their run folders."""
    folder = tmp_path / "seed0"
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("- seed=0\n")
    (folder / "config.yaml").write_text("seed: 0\n")
    metrics = {"summary": {"rl_steps": 1}, "history": {"val/accuracy": [[0, 0.5]]}}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    old = json.loads(gzip.decompress(record_bytes(folder)))
    assert old["metrics"] == metrics  # the layout before facts: summary and history only
    (folder / "metrics.json").write_text(json.dumps(metrics | {"facts": {"machine": "AMD EPYC"}}))
    assert json.loads(gzip.decompress(record_bytes(folder)))["metrics"]["facts"] == {"machine": "AMD EPYC"}


def test_the_plan_prints_the_differences_and_bad_arguments_are_one_line(capsys):
    done = subprocess.run(STUDY + ["quick", "--plan"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "grpo: estimator.name: rloo -> grpo" in done.stdout
    study = load_script("research/study.py")  # the other cases through its main, in this process
    # an override right after --only's parts (the docs' `--only smollm2 model=qwen7b`) is an override
    assert study.main(["quick", "--only", "estimators", "rl.steps=1", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "[estimators] 2 settings" in out and "[variance]" not in out
    with pytest.raises(SystemExit) as exit_:
        study.main(["quick", "--plan", "--nope"])
    assert exit_.value.code == 2 and "unknown argument --nope" in capsys.readouterr().err
    assert study.main(["quick", "--plan", "--only", "x"]) == 2
    assert "error: --only x: no such part of quick" in capsys.readouterr().out
    assert study.main(["quick", "--plan", "--settings", "rloo", "nope"]) == 2
    assert "error: --settings nope: no such setting; the settings: grpo, rloo" in capsys.readouterr().out


def test_a_key_added_later_leaves_the_digest_of_earlier_runs_at_its_neutral_value():
    """`loss.zvp_alpha` came after the exploration study's runs: at null (off) the digest is the one a
    config without the key had, so those runs keep their folder; at any other value it differs."""
    before = {"seed": 3, "loss.name": "auto", "rl.steps": 60}
    assert config_digest({**before, "loss.zvp_alpha": None}) == config_digest(before)
    assert config_digest({**before, "loss.zvp_alpha": 0.1}) != config_digest(before)
    assert LATER_KEYS["loss.zvp_alpha"] is None
    assert config_digest({**before, "seed": 4}) == config_digest(before)  # the seed never counts


def test_the_cache_path_does_not_change_a_runs_folder(monkeypatch, tmp_path):
    """`LOORL_CACHE` lands in the resolved config (`model.cache_dir`); a machine with its own cache path
    computes the same digests, so it finds the runs and records made elsewhere (the published ones)."""
    overrides = ["experiment=study_tiny3", "estimator=grpo"]
    monkeypatch.delenv("LOORL_CACHE", raising=False)
    default = resolved(overrides, 0)
    monkeypatch.setenv("LOORL_CACHE", str(tmp_path / "cache"))
    elsewhere = resolved(overrides, 0)
    assert differences(default, elsewhere) == {"model.cache_dir": ("~/.cache/loorl", str(tmp_path / "cache"))}
    assert config_digest(elsewhere) == config_digest(default)
