"""A difficulty curriculum driven by the policy's own rolling success rate, one level per source.

`Curriculum.observe` takes a training step's outcomes per source (1 correct, 0 not; every rank's
samples, in rank order) and moves each source's level: up one when the success rate over its last
`window` samples is at or above `raise_above`, down one (never below its starting level) when
`lower_below` is set and the rate is under it. A move empties that source's window, so the next
decision reads only samples drawn at the new level. Each step is observed once (a step's further
dynamic-sampling rounds, or a rollout graded again when a checkpoint is written, change nothing),
so the levels are a pure function of the steps' outcomes: a resumed run, restored from
`state_dict`, moves exactly as the uninterrupted one.

Written by hand: reasoning-gym's curricula say what a level means (`set_global_level`) but leave
when to move to the trainer (its verl recipe reads an accuracy in a callback); this is that rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from loorl.errors import ConfigError


@dataclass
class Curriculum:
    """The levels of each source and the outcomes each source's next decision reads."""

    levels: dict[str, int]  # source -> current level
    max_levels: dict[str, int]  # source -> the highest level it has
    window: int = 64  # samples of a source a decision reads
    raise_above: float = 0.8  # raise a level when the window's success rate is at or above this
    lower_below: float | None = None  # lower a level when under this (None: never)
    floors: dict[str, int] = field(default_factory=dict)  # lowest levels (the starting ones)
    recent: dict[str, list[int]] = field(default_factory=dict)  # source -> its window's outcomes
    last_step: int = -1  # the last step observed

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"task.curriculum.window={self.window} must be at least 1 sample")
        if not 0.0 < self.raise_above <= 1.0:
            raise ConfigError(f"task.curriculum.raise_above={self.raise_above} must be in (0, 1]")
        if self.lower_below is not None and not 0.0 <= self.lower_below < self.raise_above:
            raise ConfigError(
                f"task.curriculum.lower_below={self.lower_below} must be in [0, raise_above="
                f"{self.raise_above}), or null to never lower a level"
            )
        self.floors = {**dict(self.levels), **self.floors}
        self.recent = {name: list(self.recent.get(name, [])) for name in self.levels}

    @classmethod
    def from_settings(cls, settings: Mapping, *, levels: dict[str, int], max_levels: dict[str, int]):
        """The curriculum of a task's `task.curriculum` settings (window, raise_above, lower_below) over
        `levels` (source -> starting level), each source up to its `max_levels` entry."""
        lower = settings.get("lower_below")
        return cls(
            levels=dict(levels),
            max_levels=dict(max_levels),
            window=int(settings["window"]),
            raise_above=float(settings["raise_above"]),
            lower_below=None if lower is None else float(lower),
        )

    def describe(self) -> str:
        """The rule in words, for the run's facts: "raise at >= 0.8 over 64 samples, never lowered"."""
        lower = "never lowered" if self.lower_below is None else f"lowered under {self.lower_below:g}"
        return f"raise at >= {self.raise_above:g} over {self.window} samples, {lower}"

    def observe(self, step: int, outcomes: dict[str, list[int]]) -> dict[str, int]:
        """Record step `step`'s outcomes per source and move levels; returns {source: new level} of
        the sources that moved. A step at or before the last one observed changes nothing."""
        if step <= self.last_step:
            return {}
        moved = {}
        for name, results in outcomes.items():
            if name not in self.levels:
                continue
            recent = (self.recent[name] + [int(r) for r in results])[-self.window :]
            if len(recent) >= self.window:
                rate = sum(recent) / len(recent)
                level = self.levels[name]
                if rate >= self.raise_above and level < self.max_levels[name]:
                    moved[name] = level + 1
                elif self.lower_below is not None and rate < self.lower_below and level > self.floors[name]:
                    moved[name] = level - 1
                if name in moved:
                    self.levels[name], recent = moved[name], []
            self.recent[name] = recent
        self.last_step = step
        return moved

    def state_dict(self) -> dict:
        """Plain values (a checkpoint is loaded with `weights_only=True`)."""
        return {"levels": dict(self.levels), "recent": {n: list(r) for n, r in self.recent.items()},
                "last_step": self.last_step}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state["levels"]) - set(self.levels)
        if unknown:
            raise ConfigError(
                f"the checkpoint's curriculum has sources {sorted(unknown)} that task.datasets lacks: "
                "resume with the task it was trained with"
            )
        self.levels.update({n: int(v) for n, v in state["levels"].items()})
        self.recent.update({n: [int(x) for x in r] for n, r in state["recent"].items()})
        self.last_step = int(state["last_step"])
