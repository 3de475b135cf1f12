"""`loorl.util.peak_memory`: the host peak restarts at each run (a multirun's later job does not report
an earlier job's peak)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loorl.util.peak_memory import peak_memory_gb
from loorl.util.profiling import cuda_in_use

# in a fresh interpreter: this one's freed memory may stay resident (keep_freed_memory) and be reused
PROBE = """
import json
import numpy as np
from loorl.util.peak_memory import host_peak_bytes, reset_peak_memory

def resident():
    line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS:"))
    return float(line.split()[1]) * 1024

out = {"reset": reset_peak_memory(), "before": host_peak_bytes()}
block = np.ones(50_000_000)  # 400 MB, touched: resident
out["with_block"] = host_peak_bytes()
del block
reset_peak_memory()  # a later run's peak starts from what is resident now
out["after_reset"], out["resident"] = host_peak_bytes(), resident()
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reset is Linux's /proc/self/clear_refs")
def test_the_peak_follows_an_allocation_and_restarts_at_a_reset():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    m = json.loads(done.stdout)
    assert m["reset"] and m["with_block"] - m["before"] > 0.35e9
    assert m["after_reset"] < m["with_block"] - 0.3e9  # the block's peak is forgotten
    assert m["after_reset"] <= m["resident"] + 16e6


def test_peak_memory_gb_reports_cuda_only_where_it_runs():
    memory = peak_memory_gb()
    assert memory["peak_host_gb"] > 0.05
    assert np.isnan(memory["peak_cuda_gb"]) != cuda_in_use()
