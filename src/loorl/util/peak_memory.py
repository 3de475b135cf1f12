"""A run's peak memory, overall and by phase: the process's resident set on the host and, where CUDA is
in use, the allocator's peak on this rank's GPU (what the summary and `scripts/research/ablate.py` report).

A Hydra multirun trains its jobs one after another in one process, so the host peak since the
process started would be the largest job's. Linux lets a process restart that peak: writing "5" to
`/proc/self/clear_refs` resets `VmHWM` (Linux 4.0+; `getrusage`'s `ru_maxrss` with it), read back
from `/proc/self/status`. A job's peak starts from what is resident when it starts; `cli/train.py`
hands each job's memory back at its end (`loorl.util.allocator.release_memory`), so that is close to
what a fresh process holds. Elsewhere, or where that file is not writable
(`reset_peak_memory` returns False), the peak is since the process started (`getrusage`).

By phase (`phase_peak`, entered by `loorl.util.profiling.PhaseClock`): each phase boundary reads the
high-water marks and restarts them, so what a phase reads at its end is its own peak. Every value
read is also folded into the job's running maximum, which `host_peak_bytes` and `cuda_peak_bytes`
report: the restarts lose nothing of the job's peak. An outer phase gets the peaks of the phases
nested in it. The marks are per process: work of other threads during a phase counts in it.
A phase's peak includes what was resident before it; its rise (peak minus what was resident, or
allocated on CUDA, when it started) is what the phase itself added. With `keep_freed_memory` the
resident set never shrinks, so after the first steps every phase's host peak is the run's, and the
rise (the largest over steps) is what tells the phases apart: memory freed earlier is reused first.
The restarts are the kernel's: what reads the process's peak from outside (`/usr/bin/time`, a
parent's `ru_maxrss`) sees only the peak since the last phase boundary (about the run's own where
`keep_freed_memory` keeps the resident set up; less without it): the summary's peak is the run's.
No library keeps this (psutil reads VmHWM but cannot reset it; torch has no host-memory peak)."""

from __future__ import annotations

import resource
import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from loorl.util.hardware import cuda_in_use
from loorl.util.units import GiB

_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")
_HOST = ("VmHWM", "VmRSS")  # the lines of /proc/self/status read: the high-water mark, the resident set


class _Block:
    """One open phase block: what was in use when it started and the peaks reached since (bytes)."""

    def __init__(self, name: str, host: float, cuda: float) -> None:
        self.name, self.start, self.peak = name, (host, cuda), [host, cuda]


class _Peaks:
    """The job's running maxima (bytes), the open phase blocks, and each phase's peak and rise since the
    last pop: name -> [host peak, cuda peak, host rise, cuda rise]."""

    def __init__(self) -> None:
        self.host = self.cuda = 0.0
        self.open: list[_Block] = []
        self.phases: dict[str, list[float]] = defaultdict(lambda: [0.0] * 4)


_PEAKS = _Peaks()


def _restart_marks() -> bool:
    """Restart the host and CUDA high-water marks; True when the host's could be."""
    if cuda_in_use():
        torch.cuda.reset_peak_memory_stats()
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _host_now() -> tuple[float, float]:
    """The host's high-water mark since its last restart (Linux) or since the process started, and
    the resident set now (0 where /proc is not there), in bytes."""
    try:
        lines = _STATUS.read_text().splitlines()
        kb = {k: float(v.split()[0]) * 1024 for k, v in (x.split(":", 1) for x in lines) if k in _HOST}
        return kb["VmHWM"], kb["VmRSS"]
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak) * (1 if sys.platform == "darwin" else 1024), 0.0  # bytes on macOS, kB on Linux


def _cuda_now() -> tuple[float, float]:
    """The CUDA allocator's peak since its last restart and what it has allocated now (0 without CUDA)."""
    if not cuda_in_use():
        return 0.0, 0.0
    return float(torch.cuda.max_memory_allocated()), float(torch.cuda.memory_allocated())


def _fold_and_restart() -> tuple[float, float]:
    """A phase boundary: the marks since the last boundary go to the job and to every open block; the
    marks restart. Returns what is in use now (host resident, CUDA allocated)."""
    (host, host_now), (cuda, cuda_now) = _host_now(), _cuda_now()
    _PEAKS.host, _PEAKS.cuda = max(_PEAKS.host, host), max(_PEAKS.cuda, cuda)
    for block in _PEAKS.open:
        block.peak = [max(block.peak[0], host), max(block.peak[1], cuda)]
    _restart_marks()
    return host_now, cuda_now


def _close(block: _Block) -> None:
    """Fold a finished block into its phase's record: the larger peak and the larger rise."""
    record = _PEAKS.phases[block.name]
    rises = [max(0.0, peak - start) for peak, start in zip(block.peak, block.start)]
    record[:] = [max(a, b) for a, b in zip(record, [*block.peak, *rises])]


def reset_peak_memory() -> bool:
    """Start a new job's peak (host and CUDA, overall and by phase); True when the host peak could be
    reset."""
    _PEAKS.host = _PEAKS.cuda = 0.0
    _PEAKS.phases.clear()
    return _restart_marks()


@contextmanager
def phase_peak(name: str):
    """Record the peak memory reached inside the block as phase `name`'s (the largest over the blocks
    of that name since the last `pop_phase_peaks_gib`). Two reads of /proc/self/status and two writes
    to clear_refs: about 0.1 ms."""
    _PEAKS.open.append(_Block(name, *_fold_and_restart()))  # what came before is not this phase's
    try:
        yield
    finally:
        _fold_and_restart()
        _close(_PEAKS.open.pop())  # blocks nest: this one is the innermost


def pop_phase_peaks_gib() -> dict[str, float]:
    """The phases' peaks and rises since the last pop as `perf/<phase>_{peak,rise}_host_gib` metrics, in
    GiB (and `..._cuda_gib` where CUDA is in use); forgets them."""
    devices = ("host", "cuda") if cuda_in_use() else ("host",)
    out = {}
    for name, record in _PEAKS.phases.items():
        values = dict(zip(("peak_host", "peak_cuda", "rise_host", "rise_cuda"), record))
        for what in ("peak", "rise"):
            out |= {f"perf/{name}_{what}_{d}_gib": values[f"{what}_{d}"] / GiB for d in devices}
    _PEAKS.phases.clear()
    return out


def host_peak_bytes() -> float:
    """The process's peak resident memory since the last `reset_peak_memory` (Linux; phase boundaries
    in between included) or since it started."""
    return max(_PEAKS.host, _host_now()[0])


def cuda_peak_bytes() -> float:
    """The CUDA allocator's peak since the last `reset_peak_memory`; 0 where CUDA is not in use."""
    return max(_PEAKS.cuda, _cuda_now()[0])


def peak_memory_gib() -> dict[str, float]:
    """`peak_host_gib` and `peak_cuda_gib`, in GiB (NaN where CUDA is not in use)."""
    cuda = cuda_peak_bytes() / GiB if cuda_in_use() else float("nan")
    return {"peak_host_gib": host_peak_bytes() / GiB, "peak_cuda_gib": cuda}
