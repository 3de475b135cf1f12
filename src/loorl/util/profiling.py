"""Where an RL step's time goes: named phases timed on the wall clock and marked for the torch profiler.

Each phase is a `torch.profiler.record_function` range named `loorl/<phase>` (what
`scripts/bench/profile_step.py` groups the profiler's operators by) and a wall-clock sum logged as
`perf/<phase>_seconds`. The DataModule times `gen` and `grade`, the module `prepare`, `forward`,
`backward` and `optimizer`; `perf/step_seconds` is the whole step and `perf/other_seconds` what no
phase covers (Lightning's loop, logging, batch assembly, Python). Each phase also records its peak
memory and its rise (`loorl.util.peak_memory.phase_peak`), logged as `perf/<phase>_{peak,rise}_host_gib`.

On a GPU, kernels run after the Python that launched them returns: without a wait a phase measures
its launches, and the time shows up in whichever later phase first waits (`.item()`). So when this
process uses CUDA, each phase boundary synchronises (the price: the CPU no longer queues the next
phase's kernels while this phase's run); on CPU it costs one flag read. Untested on GPU here.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from loorl.util.hardware import cuda_in_use
from loorl.util.peak_memory import phase_peak

PHASES = ("gen", "grade", "prepare", "forward", "backward", "optimizer", "other")


class PhaseClock:
    def __init__(self, *, sync_cuda: bool | None = None) -> None:
        """`sync_cuda`: wait for CUDA at each phase boundary; None: whenever `cuda_in_use()`."""
        self.seconds: dict[str, float] = defaultdict(float)
        self.sync_cuda = sync_cuda

    def _wait_for_device(self) -> None:
        if self.sync_cuda if self.sync_cuda is not None else cuda_in_use():
            torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str):
        with torch.profiler.record_function(f"loorl/{name}"), phase_peak(name):
            self._wait_for_device()  # what earlier phases queued is not this phase's time
            start = time.perf_counter()
            try:
                yield
            finally:
                self._wait_for_device()  # this phase's kernels are
                self.seconds[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """The phases' seconds since the last pop, as `perf/<phase>_seconds` metrics; resets them."""
        out = {f"perf/{name}_seconds": s for name, s in self.seconds.items()}
        self.seconds.clear()
        return out
