"""A study's runs: every (setting, seed) of a train part without results, each a `src/train.py`
subprocess in `runs/<config digest>/seed<i>/` (resumed where one stopped), and a probe part's
training with checkpoints and the gradient-variance probe at each of them. What failed is reported
and left for the next invocation."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

from loorl.config import CONF_DIR
from loorl.research.probe import probe, read_results
from loorl.research.study import Part, Setting, probe_options
from loorl.research.study_records import keep_record, read_record, record_path
from loorl.util.allocator import release_memory


def run_dir(out: Path, setting: Setting, seed: int) -> Path:
    return out / "runs" / setting.digest / f"seed{seed}"


def finished(folder: Path, steps: int) -> bool:
    """The run in `folder` did all its `steps`. A run that was stopped writes `metrics.json` too (and
    `last.ckpt`, from which `resume_from=auto` continues it), with fewer `rl_steps`."""
    metrics = folder / "metrics.json"
    return metrics.is_file() and did_all_steps(json.loads(metrics.read_text())["summary"], steps)


def did_all_steps(summary: dict, steps: int) -> bool:
    """A run's summary (`metrics.json`) says it did all its `steps`."""
    return summary.get("rl_steps", 0) >= steps


def recorded(records: Path | None, setting: Setting, seed: int) -> bool:
    """The study's records (`loorl.research.study_records`) hold this run, finished."""
    if records is None:
        return False
    run = read_record(record_path(records, setting, seed), seed)
    return run is not None and did_all_steps(run.summary, setting.steps)


def train_command(setting: Setting, seed: int, folder: Path, extra: list[str] = ()) -> list[str]:
    root = CONF_DIR.parent
    return [sys.executable, str(root / "src" / "train.py"), *setting.overrides, f"seed={seed}",
            f"hydra.run.dir={folder}", "resume_from=auto", *extra]  # fmt: skip


def run_training(
    out: Path, part: Part, *, labels: list[str] | None = None, records: Path | None = None, echo=print
) -> list[Path]:
    """Every (setting, seed) of a train part without results, seed by seed (all settings of seed 0
    first: an interrupted study has whole seeds); `labels`: these settings only (the report still
    takes every finished run). A run is finished where its folder or the study's `records` say so; a
    run that finishes is recorded there at once. A run that fails is reported and left for the next
    invocation. Returns the folders that failed."""
    failed = []
    chosen = [s for s in part.settings if labels is None or s.label in labels]
    todo = [(seed, s) for seed in part.seeds for s in chosen
            if not finished(run_dir(out, s, seed), s.steps) and not recorded(records, s, seed)]  # fmt: skip
    done = len(part.seeds) * len(chosen) - len(todo)
    echo(f"[{part.name}] {done} runs finished before, {len(todo)} to run")
    for i, (seed, setting) in enumerate(todo, 1):
        folder = run_dir(out, setting, seed)
        folder.mkdir(parents=True, exist_ok=True)
        (folder.parent / "setting.json").write_text(
            json.dumps({"label": setting.label, "overrides": setting.overrides})
        )
        command = train_command(setting, seed, folder)
        echo(f"[{part.name}] run {i}/{len(todo)}: {setting.label}, seed {seed}: {shlex.join(command[1:])}")
        started = time.perf_counter()
        with open(folder / "study.log", "a") as log:
            code = subprocess.run(
                command, cwd=CONF_DIR.parent, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        seconds = time.perf_counter() - started
        if code != 0 or not finished(folder, setting.steps):
            failed.append(folder)
            echo(f"[{part.name}]   failed (exit {code}) after {seconds:.0f} s: see {folder / 'study.log'}")
        else:
            echo(f"[{part.name}]   done in {seconds:.0f} s")
            if records is not None:
                keep_record(folder, record_path(records, setting, seed))
    return failed


# ---- the gradient-variance probe at a run's checkpoints ----------------------------------------------
def probe_run_dir(out: Path, part: Part) -> Path:
    setting = part.settings[0]
    return out / "runs" / f"{setting.digest}-checkpoints" / f"seed{part.probe.get('seed', 0)}"


def checkpoints_by_step(folder: Path) -> dict[int, Path]:
    """RL step -> the periodic checkpoint saved after it (`epoch=E-step=S.ckpt`: E + 1 RL steps)."""
    found = {}
    for path in (folder / "checkpoints").glob("epoch=*.ckpt"):
        epoch = int(path.stem.split("-")[0].split("=")[1])
        found[epoch + 1] = path
    return dict(sorted(found.items()))


def probe_folder(out: Path, part: Part, step: int) -> Path:
    """Where the probe of the policy after `step` RL steps writes its results."""
    return out / "probe" / part.name / f"step{step}"


def kept_probes(records: Path | None, part: Part) -> dict[int, dict]:
    """Step -> the probe's results as the report last wrote them (`<report_dir>/<part>.json`): the
    record of a probe part."""
    path = None if records is None else records / f"{part.name}.json"
    if path is None or not path.is_file():
        return {}
    return {int(step): found for step, found in json.loads(path.read_text()).items()}


def run_probe(out: Path, part: Part, *, records: Path | None = None, echo=print) -> list[Path]:
    """Train the part's setting with a checkpoint every `probe.every` steps (all kept), then run the
    gradient-variance probe (`loorl.research.probe`) on the policy before RL and at each checkpoint;
    nothing where the report in `records` holds every step's results. Returns what failed (a failed
    probe's traceback is in its folder's study.log)."""
    setting, seed = part.settings[0], int(part.probe.get("seed", 0))
    folder = probe_run_dir(out, part)
    every = int(part.probe["every"])
    if set(range(0, setting.steps + 1, every)) <= set(kept_probes(records, part)):
        echo(f"[{part.name}] every probe is in the report's records: nothing to run")
        return []
    if not finished(folder, setting.steps):
        folder.mkdir(parents=True, exist_ok=True)
        command = train_command(setting, seed, folder, [f"checkpoint_every={every}", "checkpoint_keep=-1"])
        echo(f"[{part.name}] training with checkpoints: {shlex.join(command[1:])}")
        with open(folder / "study.log", "a") as log:
            subprocess.run(command, cwd=CONF_DIR.parent, stdout=log, stderr=subprocess.STDOUT)
        if not finished(folder, setting.steps):
            echo(f"[{part.name}]   failed: see {folder / 'study.log'}")
            return [folder]
    policies = {0: None, **checkpoints_by_step(folder)}
    failed = []
    for step, ckpt in policies.items():
        target = probe_folder(out, part, step)
        if read_results(target) is not None:
            continue
        options = probe_options(part, ckpt)
        overrides = [*setting.overrides, f"seed={seed}"]
        command = shlex.join(["python", "scripts/research/grad_variance.py", "--out", str(target),
                              *options.arguments(), *overrides])  # fmt: skip
        echo(f"[{part.name}] probe at step {step}: {command}")
        target.mkdir(parents=True, exist_ok=True)
        try:
            probe(options, overrides, target, command=command)
        except Exception:  # noqa: BLE001 - reported and retried by the next invocation, as a failed run
            (target / "study.log").write_text(traceback.format_exc())
            failed.append(target)
            echo(f"[{part.name}]   failed: see {target / 'study.log'}")
        finally:  # the probed policy and its engine go before the next one is built (in this process)
            release_memory()
    return failed
