"""A study: named parts, each a set of settings run over the same seeds, planned, checked and run so that
an interrupted study continues where it stopped (`scripts/research/study.py`, `conf/study/*.yaml`).

Every compared run differs only in what its part names: before anything runs, each setting's config is
composed and resolved, its differences from the part's first setting are printed, and a difference in a
key the part's `may_differ` does not name is an error. Across seeds, a key may change only to the
seed's own value (`seed`, a warm start's `${seed}`). A run lives in `runs/<hash of its resolved
config>/seed<i>/`, so two parts that hold the same setting (K = 4 in the K part is the estimators
part's RLOO) share its runs, and a run with `metrics.json` is finished and never run again.

This module reads and checks a study's file (`load_study`: its parts, settings, seeds, comparisons and
probe options); `loorl.research.study_configs` resolves each setting's config and checks their
differences, `loorl.research.study_runs` runs what is not finished, `loorl.research.study_pairing`
checks on the runs that the seeds were paired, and `loorl.research.study_report` writes the tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from loorl.config import CONF_DIR, ConfigError
from loorl.research.probe import ProbeOptions, parse_options

STUDY_DIR = CONF_DIR / "study"
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
    "dynamics",
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
    def report_facts(self) -> tuple[int, int, float | None]:
        """What the report reads of its config: (prompts per step, samples per step, the gradient-norm
        clip)."""
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
    dynamics: bool = False  # also entropy, groups without spread and gradient norm along training
    plan: list[str] = field(default_factory=list)  # how the settings' configs differ (check_part)
    pairing: str = "prompts"  # PAIRINGS: what run i of every setting shares (check_pairing)
    metrics: list[str] = field(default_factory=lambda: list(METRICS))  # compared: final|auc[/<dataset>]


@dataclass
class Study:
    name: str
    title: str
    report_dir: Path
    parts: list[Part]
    part_titles: tuple[str, ...] = ()  # every part's title in the file's order, `--only` or not


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
    titles = tuple(_part_title(part, spec or {}) for part, spec in parts_raw.items())
    report_dir = Path(raw.get("report_dir", f"outputs/studies/{name}"))
    return Study(name, raw.get("title", name), report_dir, parts, titles)


def _part_title(name: str, spec: dict) -> str:
    return str(spec.get("title", name))


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
    part = Part(name, _part_title(name, spec), kind, seeds, settings, list(spec.get("may_differ") or []),
                comparisons, probe_spec, bool(spec.get("lengths", False)), pairing=pairing,
                metrics=metrics, dynamics=bool(spec.get("dynamics", False)))  # fmt: skip
    if kind == "probe":
        try:
            probe_options(part, None).check()
        except ValueError as error:
            raise ConfigError(f"{where}.probe.args: {error}") from None
    return part


def probe_options(part: Part, policy: Path | None) -> ProbeOptions:
    """The probe's options of a probe part (`probe.args`, as `scripts/research/grad_variance.py` takes them;
    the study sets the policy) at `policy` (None: the policy before RL). Not yet checked."""
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
