"""Finished runs read back: a Hydra multirun's job folders as `Job`s, grouped into settings.

A job folder (`<sweep>/<n>/`) holds `.hydra/overrides.yaml` (what the job set), `config.yaml` and
`metrics.json` (`RunSummary`: the summary, every metric's history and the run's facts, its machine
among them). Jobs are grouped into settings by their overrides, leaving out `seed` and the overrides
every job shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

SEED_KEYS = ("seed",)
# overrides that change how a run looks, not what it computes: never a setting of their own
COSMETIC_KEYS = ("trainer.enable_progress_bar",)


@dataclass
class Job:
    path: Path
    overrides: list[str]  # as given to the job (`estimator=rloo`, `seed=1`, ...)
    seed: int
    summary: dict
    history: dict[str, list[tuple[int, float]]]
    config: dict
    facts: dict[str, str] = field(default_factory=dict)  # summary.md's stated lines (`machine`: what ran it)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a metric's history."""
        points = self.history.get(key, [])
        return np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)

    def cumulative_tokens(self) -> np.ndarray:
        """Generated tokens up to and including each RL step's rollout, [steps]."""
        steps, tokens = self.series("rollout/gen_tokens")
        if not len(tokens):  # a run from before rollout/gen_tokens: mean length x samples per step
            steps, length = self.series("rollout/completion_len")
            rl = self.config.get("rl", {})
            tokens = length * rl.get("prompts_per_step", 0) * rl.get("samples_per_prompt", 0)
        return np.cumsum(tokens[np.argsort(steps)])

    def cumulative_step_seconds(self) -> np.ndarray:
        """Seconds of RL steps (rollout and update; no validation, start-up or checkpoint) up to and
        including each step, [steps]: the clock two settings are compared on."""
        steps, seconds = self.series("perf/step_seconds")
        return np.cumsum(seconds[np.argsort(steps)])


def cost_before(cumulative: np.ndarray, step: float) -> float:
    """A cumulative count (tokens, seconds) over the rollouts before `step`: what the policy validated
    at `step` (after `step` updates) had cost."""
    if step == 0 or not len(cumulative):
        return 0.0 if step == 0 else float("nan")
    return float(cumulative[min(int(step) - 1, len(cumulative) - 1)])


def cost_through(cumulative: np.ndarray, step: float) -> float:
    """A cumulative count over the rollouts up to and including `step`: what step `step`'s own
    rollout (its reward) had cost."""
    return float(cumulative[min(int(step), len(cumulative) - 1)])


@dataclass
class Setting:
    label: str
    jobs: list[Job] = field(default_factory=list)


def override_key(override: str) -> str:
    """The dotted key an override sets (`+a.b=1`, `~a.b` and `a.b=1` all set `a.b`)."""
    return override.split("=", 1)[0].lstrip("+~")


def read_jobs(sweep_dirs: list[Path]) -> tuple[list[Job], list[Path]]:
    """The finished jobs under the sweep folders (in job order), and the job folders without results."""
    jobs, unfinished = [], []
    for sweep in sweep_dirs:
        found = Path(sweep).rglob(".hydra/overrides.yaml")
        for overrides_file in sorted(found, key=lambda f: _numeric_parts(f.relative_to(sweep))):
            folder = overrides_file.parent.parent
            metrics = folder / "metrics.json"
            if not metrics.is_file():
                unfinished.append(folder)
                continue
            overrides = [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []]
            data = json.loads(metrics.read_text())
            config_file = folder / "config.yaml"
            config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
            seed = next((int(o.split("=", 1)[1]) for o in overrides if override_key(o) in SEED_KEYS), 0)
            history = {k: [tuple(p) for p in v] for k, v in data["history"].items()}
            facts = data.get("facts", {})  # runs from before metrics.json kept them have none
            jobs.append(Job(folder, overrides, seed, data["summary"], history, config or {}, facts))
    return jobs, unfinished


def _numeric_parts(path: Path) -> tuple:
    """A sort key that puts Hydra's job folders 0, 1, ..., 10 in numeric order."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def group_settings(jobs: list[Job]) -> list[Setting]:
    """Jobs grouped by their overrides without the seed and without what every job shares; settings in
    the order their first job ran. A setting's label is its distinguishing overrides (the value
    alone when one key varies)."""
    shared = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    ignored = SEED_KEYS + COSMETIC_KEYS
    settings: dict[tuple, Setting] = {}
    varying_keys = {
        override_key(o)
        for j in jobs
        for o in j.overrides
        if o not in shared and override_key(o) not in ignored
    }
    for job in jobs:
        own = tuple(o for o in job.overrides if o not in shared and override_key(o) not in ignored)
        if own not in settings:
            parts = [o.split("=", 1)[1] if len(varying_keys) == 1 else o.lstrip("+") for o in own]
            settings[own] = Setting(", ".join(parts) or ("(no override)" if varying_keys else "(all runs)"))
        settings[own].jobs.append(job)
    return list(settings.values())
