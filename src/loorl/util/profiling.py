"""Where an RL step's time goes: named phases timed on the wall clock and marked for the torch profiler.

Each phase is a `torch.profiler.record_function` range named `loorl/<phase>` (what
`scripts/profile_step.py` groups the profiler's operators by) and a wall-clock sum logged as
`perf/<phase>_seconds`. The DataModule times `gen` and `grade`, the module `prepare`, `forward`,
`backward` and `optimizer`; `perf/step_seconds` is the whole step and `perf/other_seconds` what no
phase covers (Lightning's loop, logging, batch assembly, Python).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("gen", "grade", "prepare", "forward", "backward", "entropy", "optimizer", "other")


class PhaseClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        with torch.profiler.record_function(f"loorl/{name}"):
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """The phases' seconds since the last pop, as `perf/<phase>_seconds` metrics; resets them."""
        out = {f"perf/{name}_seconds": s for name, s in self.seconds.items()}
        self.seconds.clear()
        return out
