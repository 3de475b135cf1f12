"""A study: named parts, each a set of settings run over the same seeds, planned, checked and run so that
an interrupted study continues where it stopped (`scripts/study.py`, `conf/study/*.yaml`).

Every compared run differs only in what its part names: before anything runs, each setting's config is
composed and resolved, its differences from the part's first setting are printed, and a difference in a
key the part's `may_differ` does not name is an error. Across seeds, a key may change only to the
seed's own value (`seed`, a warm start's `${seed}`). A run lives in `runs/<hash of its resolved
config>/seed<i>/`, so two parts that hold the same setting (K = 4 in the K part is the estimators
part's RLOO) share its runs, and a run with `metrics.json` is finished and never run again.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from loorl.config import CONF_DIR, ConfigError, compose_config
from loorl.research.probe import ProbeOptions, parse_options, probe, read_results
from loorl.util.allocator import release_memory

STUDY_DIR = CONF_DIR / "study"
RUN_KEYS = ("output_dir", "resume_from")  # where a run writes and how it restarts: not what it computes
PART_KEYS = {
    "title",
    "kind",
    "overrides",
    "seeds",
    "settings",
    "may_differ",
    "reference",
    "compare",
    "probe",
    "lengths",
    "pairing",
    "metrics",
}
METRICS = ("final", "auc")  # a part's compared metrics by default; each may name a dataset (final/<name>)
PAIRINGS = ("prompts", "seeds")  # a part's pairing: the same prompts at every step, or the same seeds only
PROBE_KEYS = {"seed", "every", "args", "beside"}


@dataclass
class Setting:
    label: str
    overrides: list[str]  # the part's shared overrides, the setting's own, then the command line's
    config: dict = field(default_factory=dict)  # resolved at the part's first seed (`check_part`)
    digest: str = ""  # of its resolved config without RUN_KEYS and the seed: its runs' folder

    @property
    def steps(self) -> int:
        """Its rl.steps: a run is finished when it has done them all."""
        return int(self.config["rl.steps"])

    @property
    def samples_per_step(self) -> tuple[int, int, float | None]:
        """(prompts per step, samples per step, the gradient-norm clip)."""
        b = int(self.config["rl.prompts_per_step"])
        return b, b * int(self.config["rl.samples_per_prompt"]), self.config["loss.max_grad_norm"]


@dataclass
class Part:
    name: str
    title: str
    kind: str  # train: settings x seeds | probe: the gradient-variance probe at a run's checkpoints
    seeds: list[int]
    settings: list[Setting]
    may_differ: list[str]
    comparisons: list[tuple[str, str]]  # (a, b): a - b per seed
    probe: dict = field(default_factory=dict)
    lengths: bool = False  # also the length of correct and wrong answers along training
    plan: list[str] = field(default_factory=list)  # how the settings' configs differ (check_part)
    pairing: str = "prompts"  # PAIRINGS: what run i of every setting shares (check_pairing)
    metrics: list[str] = field(default_factory=lambda: list(METRICS))  # compared: final|auc[/<dataset>]


@dataclass
class Study:
    name: str
    title: str
    report_dir: Path
    parts: list[Part]


def study_names() -> list[str]:
    return sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))


def load_study(
    name: str, *, seeds: int | None = None, only: list[str] | None = None, extra: list[str] = ()
) -> Study:
    """The study `conf/study/<name>.yaml`, its parts checked (`only`: those parts; `seeds`: at most the
    first N seeds of each part; `extra`: overrides appended to every setting, such as `model=qwen7b`).
    Bad files are a one-line ConfigError naming the key and the fix."""
    path = STUDY_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no study {name!r}: choose one of {', '.join(study_names())} (conf/study/)")
    raw = yaml.safe_load(path.read_text()) or {}
    parts_raw = raw.get("parts") or {}
    if not parts_raw:
        raise ConfigError(f"conf/study/{name}.yaml has no parts: add a parts: mapping")
    unknown = sorted(set(only or []) - set(parts_raw))
    if unknown:
        raise ConfigError(f"--only {unknown[0]}: no such part of {name}; its parts: {', '.join(parts_raw)}")
    parts = [
        _part(name, part, spec or {}, seeds, list(extra))
        for part, spec in parts_raw.items()
        if not only or part in only
    ]
    return Study(name, raw.get("title", name), Path(raw.get("report_dir", f"outputs/studies/{name}")), parts)


def _part(study: str, name: str, spec: dict, max_seeds: int | None, extra: list[str]) -> Part:
    where = f"conf/study/{study}.yaml parts.{name}"
    unknown = sorted(set(spec) - PART_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(PART_KEYS))}")
    kind = spec.get("kind", "train")
    if kind not in ("train", "probe"):
        raise ConfigError(f"{where}.kind={kind!r}: choose train or probe")
    shared = [str(o) for o in spec.get("overrides") or []]
    settings = [  # the command line's overrides last: they win over the file's, as on train.py's
        Setting(str(label), shared + [str(o) for o in own or []] + extra)
        for label, own in (spec.get("settings") or {}).items()
    ]
    if not settings:
        raise ConfigError(f"{where}: no settings: add settings: {{label: [overrides]}}")
    n = int(spec.get("seeds", 1))
    if n < 1:
        raise ConfigError(f"{where}.seeds={n}: at least 1")
    seeds = list(range(min(n, max_seeds) if max_seeds else n))
    labels = [s.label for s in settings]
    comparisons = [(str(a), str(b)) for a, b in spec.get("compare") or []]
    reference = spec.get("reference")
    if reference is not None:
        comparisons = [(label, str(reference)) for label in labels if label != reference] + comparisons
    for a, b in comparisons:
        for label in (a, b):
            if label not in labels:
                raise ConfigError(f"{where}: compares {label!r}, which is not one of its settings: {labels}")
    pairing = spec.get("pairing", "prompts")
    if pairing not in PAIRINGS:
        raise ConfigError(
            f"{where}.pairing={pairing!r}: choose prompts (every setting draws the same prompts) or seeds "
            "(the same RL seed and starting policy; the prompts may differ, as across training levels)"
        )
    metrics = [str(m) for m in spec.get("metrics") or METRICS]
    for metric in metrics:
        if metric.split("/", 1)[0] not in METRICS or metric.endswith("/"):
            raise ConfigError(
                f"{where}.metrics has {metric!r}: each is final or auc, for all datasets, or "
                "final/<dataset>, auc/<dataset> (a val/accuracy/<dataset> key, such as final/chain_sum@L1)"
            )
    probe_spec = dict(spec.get("probe") or {})
    if kind == "probe":
        unknown = sorted(set(probe_spec) - PROBE_KEYS)
        if unknown or "every" not in probe_spec:
            raise ConfigError(f"{where}.probe: keys {', '.join(sorted(PROBE_KEYS))} (every is required)")
    part = Part(name, spec.get("title", name), kind, seeds, settings, list(spec.get("may_differ") or []),
                comparisons, probe_spec, bool(spec.get("lengths", False)), pairing=pairing,
                metrics=metrics)  # fmt: skip
    if kind == "probe":
        try:
            probe_options(part, None).check()
        except ValueError as error:
            raise ConfigError(f"{where}.probe.args: {error}") from None
    return part


# ---- the resolved configs and their differences -------------------------------------------------------
def resolved(overrides: list[str], seed: int) -> dict[str, object]:
    """The resolved config of a run, flattened to dotted keys, without RUN_KEYS."""
    cfg = compose_config(*overrides, f"seed={seed}", "output_dir=/study/run")
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    return {k: v for k, v in flat.items() if k not in RUN_KEYS}


def _flatten(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out |= _flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: node}


def differences(a: dict, b: dict) -> dict[str, tuple[object, object]]:
    """key -> (a's value, b's value) where they differ (a missing key reads as `<absent>`)."""
    absent = "<absent>"
    return {
        k: (a.get(k, absent), b.get(k, absent))
        for k in sorted(set(a) | set(b))
        if a.get(k, absent) != b.get(k, absent)
    }


def named(key: str, may_differ: list[str]) -> bool:
    return any(key == m or key.startswith(m + ".") for m in may_differ)


def check_part(part: Part, *, echo=print) -> None:
    """Compose every setting (seed 0, and the first setting at a second seed), keep each setting's
    resolved config and digest, print the differences and raise ConfigError at the first one the part
    does not name."""
    configs = {}
    for setting in part.settings:
        setting.config = configs[setting.label] = resolved(setting.overrides, part.seeds[0])
        setting.digest = config_digest(setting.config)
    first = part.settings[0]
    echo(
        f"[{part.name}] {len(part.settings)} settings x seeds {part.seeds}; "
        f"they differ from {first.label!r} in:"
    )
    part.plan = []
    for setting in part.settings[1:]:
        diff = differences(configs[first.label], configs[setting.label])
        shown = "; ".join(f"{k}: {a} -> {b}" for k, a, b in ((k, *v) for k, v in diff.items())) or "nothing"
        part.plan.append(f"{setting.label}: {shown}")
        echo(f"  {setting.label}: {shown}")
        stray = [k for k in diff if not named(k, part.may_differ)]
        if stray:
            a, b = diff[stray[0]]
            raise ConfigError(
                f"study part {part.name}: setting {setting.label!r} also changes {stray[0]} ({a} -> {b}), "
                f"which may_differ ({part.may_differ}) does not name: pin it in the overrides or name it"
            )
    if len(part.seeds) > 1:
        seed = part.seeds[1]
        for key, (a, b) in differences(configs[first.label], resolved(first.overrides, seed)).items():
            if (a, b) != (part.seeds[0], seed):
                raise ConfigError(
                    f"study part {part.name}: {key} changes with the seed ({a} -> {b}) but is not the seed: "
                    "seeds may change only the seed and what takes its value"
                )


def config_digest(config: dict) -> str:
    """A short hash of a resolved config without its seed-valued keys: the folder of a setting's runs."""
    seed = config.get("seed")
    kept = {k: v for k, v in config.items() if not ((k == "seed" or k.endswith(".seed")) and v == seed)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:10]


# ---- running ---------------------------------------------------------------------------------------
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


def train_command(setting: Setting, seed: int, folder: Path, extra: list[str] = ()) -> list[str]:
    root = CONF_DIR.parent
    return [sys.executable, str(root / "src" / "train.py"), *setting.overrides, f"seed={seed}",
            f"hydra.run.dir={folder}", "resume_from=auto", *extra]  # fmt: skip


def run_training(out: Path, part: Part, *, echo=print) -> list[Path]:
    """Every (setting, seed) of a train part without results, seed by seed (all settings of seed 0
    first: an interrupted study has whole seeds); a run that fails is reported and left for the next
    invocation. Returns the folders that failed."""
    failed = []
    todo = [
        (seed, s)
        for seed in part.seeds
        for s in part.settings
        if not finished(run_dir(out, s, seed), s.steps)
    ]
    done = len(part.seeds) * len(part.settings) - len(todo)
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


def probe_options(part: Part, policy: Path | None) -> ProbeOptions:
    """The probe's options of a probe part (`probe.args`, as `scripts/grad_variance.py` takes them; the
    study sets the policy) at `policy` (None: the policy before RL). Not yet checked."""
    args = [str(a) for a in part.probe.get("args", [])]
    try:
        if "--policy" in args:
            raise ValueError("--policy is the study's")
        options = parse_options(args)
    except ValueError:
        names = [f"--{f.name}" for f in fields(ProbeOptions) if f.name != "policy"]
        raise ConfigError(
            f"study part {part.name}: probe.args {args} should be pairs such as [--prompts, 32]; the "
            f"options: {', '.join(names)}"
        ) from None
    return replace(options, policy=None if policy is None else str(policy))


def probe_folder(out: Path, part: Part, step: int) -> Path:
    """Where the probe of the policy after `step` RL steps writes its results."""
    return out / "probe" / part.name / f"step{step}"


def run_probe(out: Path, part: Part, *, echo=print) -> list[Path]:
    """Train the part's setting with a checkpoint every `probe.every` steps (all kept), then run the
    gradient-variance probe (`loorl.research.probe`) on the policy before RL and at each checkpoint.
    Returns what failed (a failed probe's traceback is in its folder's study.log)."""
    setting, seed = part.settings[0], int(part.probe.get("seed", 0))
    folder = probe_run_dir(out, part)
    every = int(part.probe["every"])
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
        command = shlex.join(["python", "scripts/grad_variance.py", "--out", str(target),
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


# ---- paired seeds, checked on the runs ------------------------------------------------------------
def digests(history: dict) -> dict[int, float]:
    return {int(step): value for step, value in history.get("rollout/prompt_digest", [])}


def check_pairing(
    runs: dict[str, dict[int, dict]], prompts_per_step: dict[str, int], *, pairing: str = "prompts"
) -> list[str]:
    """From the runs' own `rollout/prompt_digest` histories (`runs`: label -> seed -> history): settings
    that draw the same number of prompts per step must have drawn the same prompts at every step for
    each seed, and two seeds must differ. With `pairing="seeds"` (settings that train on other problems
    by design, such as other levels) only the seeds must differ. Returns the finding per group as
    lines; raises ValueError on a broken pairing."""
    if pairing == "seeds":
        return [seeds_differ(runs)]
    lines = []
    groups: dict[int, list[str]] = {}
    for label, b in prompts_per_step.items():
        groups.setdefault(b, []).append(label)
    for b, labels in groups.items():
        seeds = sorted({s for label in labels for s in runs.get(label, {})})
        for seed in seeds:
            have = {label: digests(runs[label][seed]) for label in labels if seed in runs.get(label, {})}
            first_label, first = next(iter(have.items()))
            if not first:
                raise ValueError(
                    f"seed {seed}, {first_label}: no rollout/prompt_digest logged (a run from before it?)"
                )
            for label, d in have.items():
                common = sorted(set(first) & set(d))
                bad = [s for s in common if first[s] != d[s]]
                if bad or not common:
                    raise ValueError(
                        f"seed {seed}: {label!r} drew other prompts than {first_label!r} at step "
                        f"{bad[0] if bad else '(none in common)'}: the seeds are not paired"
                    )
        if len(seeds) > 1:
            label = next((lb for lb in labels if {seeds[0], seeds[1]} <= set(runs.get(lb, {}))), None)
            if label:
                check_seeds_differ(label, runs[label], seeds[:2])
        lines.append(
            f"{len(labels)} setting(s) with {b} prompts per step: for each of seeds {seeds}, every run drew "
            "the same prompts in the same order at every step (rollout/prompt_digest); the seeds differ."
        )
    return lines


def check_seeds_differ(label: str, by_seed: dict[int, dict], seeds: list[int]) -> None:
    """Raise where `label`'s runs of two `seeds` drew the same prompts at their first step: the seed did
    not reach the sampler (two seeds' first 96 prompts never coincide by chance)."""
    first = [digests(by_seed[s]) for s in seeds]
    if not all(first):
        raise ValueError(f"{label!r}: no rollout/prompt_digest logged (a run from before it?)")
    if first[0][min(first[0])] == first[1][min(first[1])]:
        raise ValueError(f"{label!r}: seeds {seeds[0]} and {seeds[1]} drew the same prompts")


def seeds_differ(runs: dict[str, dict[int, dict]]) -> str:
    """The finding of a part paired by seed only: within every setting, two seeds drew other prompts at
    their first step (the seed reached the sampler). Raises ValueError where they did not."""
    for label, by_seed in runs.items():
        if len(by_seed) >= 2:
            check_seeds_differ(label, by_seed, sorted(by_seed)[:2])
    return (
        "run i of every setting has RL seed i and the same starting policy; the settings train on other "
        "problems by design (pairing: seeds), and within each setting the seeds drew other prompts "
        "(rollout/prompt_digest)."
    )
