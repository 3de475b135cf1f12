"""A run's peak memory: the process's resident set on the host and, where CUDA is in use, the
allocator's peak on this rank's GPU (what the summary and `scripts/ablate.py` report).

A Hydra multirun trains its jobs one after another in one process, so the host peak since the
process started would be the largest job's. Linux lets a process restart that peak: writing "5" to
`/proc/self/clear_refs` resets `VmHWM` (Linux 4.0+), read back from `/proc/self/status`. The peak
then starts from what is resident, earlier jobs' leftovers included (in one 6-job SmolLM2 sweep the
peaks grew from 7 to 21 GB; `keep_freed_memory` keeps freed pages resident, and whether the rest is
fragmentation or a leak was not investigated), so a later job's figure is an upper bound on its own.
Elsewhere, or where that file is not writable (`reset_peak_memory` returns False), the peak is since
the process started (`getrusage`). No library keeps this (psutil reads VmHWM but cannot reset it)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from loorl.util.profiling import cuda_in_use

_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")
GB = 1e9


def reset_peak_memory() -> bool:
    """Start a new peak (host and CUDA); True when the host peak could be reset."""
    if cuda_in_use():
        torch.cuda.reset_peak_memory_stats()
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def host_peak_bytes() -> float:
    """The process's peak resident memory since the last reset (Linux) or since it started."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak) * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, kB on Linux


def peak_memory_gb() -> dict[str, float]:
    """`peak_host_gb` and `peak_cuda_gb` (NaN where CUDA is not in use)."""
    cuda = torch.cuda.max_memory_allocated() / GB if cuda_in_use() else float("nan")
    return {"peak_host_gb": host_peak_bytes() / GB, "peak_cuda_gb": cuda}
