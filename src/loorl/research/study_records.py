"""A study's finished runs kept beside its report, so that the report can be written again, and the study
extended, where the run folders are gone (a fresh clone, another machine, a later session).

A record is `<report_dir>/runs/<config digest>/seed<i>.json.gz`: what the report reads from a run
folder (the overrides it was given, its resolved config, and `metrics.json`: the summary, every
metric's history and the stated facts, the machine among them), and nothing else (no weights, no
logs). It is gzipped JSON with a fixed timestamp, so the same run gives the same bytes. A finished run
with a record is never run again; a report takes each (setting, seed) from its run folder where that
run is finished, else from its record.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from loorl.research.jobs import SEED_KEYS, Job, override_key, read_jobs
from loorl.research.study import Part, Setting
from loorl.research.study_configs import PLACE_KEYS, RUN_FOLDER, RUN_KEYS, differences, digested, flatten


def record_path(report_dir: Path, setting: Setting, seed: int) -> Path:
    return report_dir / "runs" / setting.digest / f"seed{seed}.json.gz"


def record_bytes(folder: Path) -> bytes:
    """The record of the finished run in `folder`, read as every report reads a run folder
    (`loorl.research.jobs.read_jobs`), as the bytes a record file holds."""
    run = read_run(folder)
    metrics = {"summary": run.summary, "history": run.history}  # metrics.json's keys
    if run.facts:  # a run from before metrics.json kept its facts gives the bytes it gave then
        metrics["facts"] = run.facts
    record = {"overrides": run.overrides, "config": run.config, "metrics": metrics}
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)  # mtime=0: the same run, the same bytes


def keep_record(folder: Path, path: Path) -> bool:
    """Write (or bring up to date) the record of the finished run in `folder` at `path`; whether it
    changed."""
    data = record_bytes(folder)
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return True


def read_record(path: Path, seed: int) -> Job | None:
    """The run a record holds, as the report reads a run folder; None where there is no record."""
    if not path.is_file():
        return None
    record = json.loads(gzip.decompress(path.read_bytes()))
    metrics = record["metrics"]
    history = {k: [tuple(p) for p in v] for k, v in metrics["history"].items()}
    facts = metrics.get("facts", {})  # records from before runs kept their facts have none
    return Job(path, record["overrides"], seed, metrics["summary"], history, record["config"], facts)


def read_run(folder: Path) -> Job | None:
    """The run in a run folder, where it wrote its metrics; None otherwise."""
    jobs = read_jobs([folder])[0]
    return jobs[0] if jobs else None


def _own_overrides(overrides: list[str]) -> tuple[str, ...]:
    """A run's overrides without those that do not change what it computes: its seed, where it runs and
    restarts (RUN_KEYS) and where it reads its cache (PLACE_KEYS)."""
    skipped = {*RUN_KEYS, *PLACE_KEYS, *SEED_KEYS}
    return tuple(o for o in overrides if override_key(o) not in skipped)


def _run_path(value: object) -> bool:
    """A value that is the run's folder (the logger's, the trainer's), as `resolved` composes it."""
    return RUN_FOLDER in str(value)


Recorded = dict[tuple[str, ...], dict[str, dict[int, dict]]]  # own overrides -> digest -> seed -> config


def recorded_configs(report_dir: Path) -> Recorded:
    """Every record's config under `report_dir/runs`, by its setting's own overrides (`_own_overrides`)
    and its folder's digest: read once a study, however many parts look into it."""
    found: Recorded = {}
    for path in sorted((report_dir / "runs").glob("*/seed*.json.gz")):
        seed = path.name.removeprefix("seed").removesuffix(".json.gz")
        if not seed.isdigit():  # not a record_path name: another file, left alone
            continue
        record = json.loads(gzip.decompress(path.read_bytes()))
        seed = int(seed)
        by_digest = found.setdefault(_own_overrides(record["overrides"]), {})
        by_digest.setdefault(path.parent.name, {})[seed] = record["config"]
    return found


def resolved_elsewhere(recorded: Recorded, part: Part) -> list[str]:
    """What keeps a train part's records (`recorded_configs`) from counting here: for each setting with
    records of its overrides under other digests only (another config than this machine resolves), the
    keys that differ, a line per set of differences. A SmolLM2 recipe resolves `model.dtype` to bfloat16
    on a CPU with bf16 units and to float32 on one without: run there, the study would start new runs
    beside the published ones rather than add seeds to them, so the study says so before it runs."""
    if part.kind != "train":
        return []
    lines: dict[str, list[str]] = {}  # the differences -> the settings with them
    for setting in part.settings:
        by_digest = recorded.get(_own_overrides(setting.overrides), {})
        if not by_digest or setting.digest in by_digest:
            continue
        here = digested(setting.config)
        for by_seed in by_digest.values():  # its config at the seed the setting is resolved at, if recorded
            config = by_seed.get(part.seeds[0], by_seed[min(by_seed)])
            there = digested({k: v for k, v in flatten(config).items() if k not in RUN_KEYS})
            moved = [f"{k}: {a} -> {b}" for k, (a, b) in differences(there, here).items()
                     if not _run_path(here.get(k, there.get(k)))]  # fmt: skip
            lines.setdefault("; ".join(moved) or "no key but the run's folder", []).append(setting.label)
    return [
        f"[{part.name}] {', '.join(labels)}: recorded with another config than this machine resolves "
        f"({text}): runs here are new runs, not more seeds of the recorded ones"
        for text, labels in lines.items()
    ]
