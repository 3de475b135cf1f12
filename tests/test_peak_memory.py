"""`loorl.util.peak_memory`: the host peak restarts at each run (a multirun's later job does not report
an earlier job's peak), each phase's peak is its own, and a multirun's jobs do not grow."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures import child_env
from loorl.training.run_report import MEMORY_PHASES, phase_memory_table
from loorl.util.peak_memory import peak_memory_gib
from loorl.util.profiling import cuda_in_use

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9 / 2**30  # one GB in GiB, the unit of every figure read here: the thresholds below are in GB
LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the reset is Linux's /proc/self/clear_refs"
)

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


def _fresh(code: str) -> dict:
    """What `code` prints (JSON), run in a fresh interpreter on this checkout's source."""
    env = child_env()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@LINUX_ONLY
def test_the_peak_follows_an_allocation_and_restarts_at_a_reset():
    m = _fresh(PROBE)
    assert m["reset"] and m["with_block"] - m["before"] > 0.35e9
    assert m["after_reset"] < m["with_block"] - 0.3e9  # the block's peak is forgotten
    assert m["after_reset"] <= m["resident"] + 16e6


def test_peak_memory_gib_reports_cuda_only_where_it_runs():
    memory = peak_memory_gib()
    assert memory["peak_host_gib"] > 0.05 * GB
    assert np.isnan(memory["peak_cuda_gib"]) != cuda_in_use()


# a phase that allocates 400 MB between two that do not; then the job's peak and a new job's
PHASES_PROBE = """
import json
import torch
from loorl.util.peak_memory import host_peak_bytes, pop_phase_peaks_gib, reset_peak_memory
from loorl.util.profiling import PhaseClock

reset_peak_memory()
clock = PhaseClock()
with clock.phase("gen"):
    pass
with clock.phase("backward"):
    block = torch.ones(50_000_000, dtype=torch.float64)  # 400 MB, touched: resident
    del block
with clock.phase("optimizer"):
    with clock.phase("entropy"):  # nested: the outer phase gets the inner one's peak too
        block = torch.ones(25_000_000, dtype=torch.float64)  # 200 MB
        del block
out = {"phases": pop_phase_peaks_gib(), "again": pop_phase_peaks_gib(), "job": host_peak_bytes() / 2**30}
reset_peak_memory()
out["next_job"] = host_peak_bytes() / 2**30
print(json.dumps(out))
"""


@LINUX_ONLY
def test_each_phase_reports_its_own_peak_and_the_job_keeps_the_largest():
    m = _fresh(PHASES_PROBE)
    p = m["phases"]
    assert set(p) == {f"perf/{n}_{w}_host_gib" for n in ("gen", "backward", "optimizer", "entropy")
                      for w in ("peak", "rise")}  # fmt: skip
    assert p["perf/backward_peak_host_gib"] - p["perf/gen_peak_host_gib"] > 0.35 * GB
    assert p["perf/backward_rise_host_gib"] > 0.35 * GB and p["perf/gen_rise_host_gib"] < 0.02 * GB
    assert (
        0.15 * GB < p["perf/entropy_rise_host_gib"] < 0.3 * GB
        and p["perf/optimizer_rise_host_gib"] > 0.15 * GB
    )
    assert m["again"] == {}  # a pop forgets
    # the phase resets lose nothing of the job's peak; a new job starts from what is resident
    assert m["job"] == pytest.approx(p["perf/backward_peak_host_gib"], abs=0.02 * GB)
    assert m["next_job"] < m["job"] - 0.3 * GB


class FakeCudaAllocator:
    """torch.cuda's peak statistics, without a GPU: `alloc`/`free` move the allocated bytes."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def reset_peak(self) -> None:
        self.peak = self.allocated


def test_cuda_peaks_by_phase_and_the_jobs_peak_across_the_restarts(monkeypatch):
    """The CUDA path with a faked allocator (untested on a GPU here): each phase's peak and rise, and
    the job's peak, which the phase boundaries' restarts of torch's peak do not lose."""
    from loorl.util import peak_memory

    gpu = FakeCudaAllocator()
    monkeypatch.setattr(peak_memory, "cuda_in_use", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: gpu.peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: gpu.allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: gpu.reset_peak())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    peak_memory.reset_peak_memory()
    gpu.alloc(100)  # the weights, before any phase
    with peak_memory.phase_peak("forward"):
        gpu.alloc(500)  # activations, kept for the backward
    with peak_memory.phase_peak("backward"):
        gpu.alloc(300)
        gpu.free(800)
    with peak_memory.phase_peak("optimizer"):
        gpu.alloc(50)
        gpu.free(50)
    p = peak_memory.pop_phase_peaks_gib()
    gib = peak_memory.GiB
    assert p["perf/forward_peak_cuda_gib"] * gib == 600 and p["perf/forward_rise_cuda_gib"] * gib == 500
    assert p["perf/backward_peak_cuda_gib"] * gib == 900 and p["perf/backward_rise_cuda_gib"] * gib == 300
    assert p["perf/optimizer_peak_cuda_gib"] * gib == 150 and p["perf/optimizer_rise_cuda_gib"] * gib == 50
    assert peak_memory.cuda_peak_bytes() == 900  # the backward's, after two restarts since
    assert peak_memory.peak_memory_gib()["peak_cuda_gib"] * gib == 900
    peak_memory.reset_peak_memory()  # a new job
    assert peak_memory.cuda_peak_bytes() == 100


def test_the_summary_table_shows_the_measured_phases_and_cuda_only_where_used():
    nan = float("nan")
    keys = ("peak_host", "rise_host", "peak_cuda", "rise_cuda")
    s = {f"{p}_{k}_gib": nan for p in MEMORY_PHASES for k in keys}
    assert phase_memory_table(s) == []  # nothing measured (e.g. a run without steps): no table
    s |= {"gen_peak_host_gib": 1.5, "gen_rise_host_gib": 0.25, "backward_peak_host_gib": 2.0,
          "backward_rise_host_gib": 0.5}  # fmt: skip
    lines = phase_memory_table(s)
    assert lines[-3:] == ["| --- | --- | --- |", "| gen | 1.500 | 0.250 |", "| backward | 2.000 | 0.500 |"]
    s |= {"gen_peak_cuda_gib": 3.0, "gen_rise_cuda_gib": 1.0, "backward_peak_cuda_gib": 4.0,
          "backward_rise_cuda_gib": 2.0}  # fmt: skip
    assert phase_memory_table(s)[-1] == "| backward | 2.000 | 0.500 | 4.000 | 2.000 |"
    assert "CUDA peak" in phase_memory_table(s)[-4]


# ---- a multirun's jobs do not grow ----------------------------------------------------------------
# a 13M-parameter tiny model (weights, gradients and AdamW about 0.2 GB): left to the garbage
# collector and to the kept heap, a 4-job sweep's peaks grew 1.09 -> 1.31 GB (+20%) here
WIDER = ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=2048", "model.tiny.num_heads=8",
         "model.tiny.warm_start.max_steps=2"]  # fmt: skip


@pytest.fixture(scope="module")
def sweep(model_cache, tmp_path_factory) -> Path:
    """Four jobs of one setting in one process (`python src/train.py -m`), as
    `scripts/research/ablate.py` runs them."""
    out = tmp_path_factory.mktemp("sweep")
    command = [sys.executable, str(ROOT / "src" / "train.py"), "-m", "seed=0,0,0,0", "debug=quick",
               "rollout=hf", f"model.cache_dir={model_cache}", *WIDER, "val_every=100", "val_pass_k=0",
               "task.eval_size=32",  # (the step-0 validation: 32 greedy prompts, not 200 and 4 samples each)
               "checkpoint_every=0", "export_policy=false", "trainer.enable_progress_bar=false",
               f"hydra.sweep.dir={out}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@LINUX_ONLY
def test_a_multiruns_later_jobs_peak_where_the_first_did(sweep):
    summaries = [json.loads((sweep / str(i) / "metrics.json").read_text())["summary"] for i in range(4)]
    peaks = [s["peak_host_gib"] for s in summaries]
    assert peaks[0] > 0.5 * GB  # torch and the model
    assert max(peaks[1:]) < 1.1 * peaks[0], peaks


def test_each_job_logs_and_summarises_its_memory_by_phase(sweep):
    run = sweep / "0"
    summary = json.loads((run / "metrics.json").read_text())["summary"]
    for phase in ("gen", "grade", "prepare", "forward", "backward", "optimizer"):
        assert 0 < summary[f"{phase}_peak_host_gib"] <= summary["peak_host_gib"] + 1e-9
        assert 0 <= summary[f"{phase}_rise_host_gib"] <= summary[f"{phase}_peak_host_gib"]
    text = (run / "summary.md").read_text()
    assert "| phase | host peak | host rise |" in text
    assert f"| backward | {summary['backward_peak_host_gib']:.3f} |" in text
    header = next(iter(csv.reader((run / "csv").rglob("metrics.csv").__next__().open())))
    assert "perf/backward_peak_host_gib" in header and "perf/gen_rise_host_gib" in header


def test_the_export_starts_without_the_optimizer_state():
    """`HFExport` empties the optimizers' state before `save_pretrained` (its AdamW moments are twice
    the float32 weights, and the run is over): the moments are gone, the weights are untouched."""
    from types import SimpleNamespace

    from loorl.training.callbacks import drop_optimizer_state

    layer = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    weights = layer.weight.detach().clone()
    assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in optimizer.state.values()) == 2 * (
        64 * 64 + 64
    )
    drop_optimizer_state(SimpleNamespace(optimizers=[optimizer]))
    assert len(optimizer.state) == 0
    assert torch.equal(layer.weight, weights)


CHECKPOINT_PROBE = """
import json, os, tempfile
import torch
from loorl.training.checkpoints import AtomicCheckpointIO
from loorl.util.peak_memory import host_peak_bytes, reset_peak_memory

state = {"state_dict": {"w": torch.ones(50_000_000)}, "optimizer_states": []}  # 200 MB of tensors
path = os.path.join(tempfile.mkdtemp(), "last.ckpt")
reset_peak_memory()
before = host_peak_bytes()
AtomicCheckpointIO().save_checkpoint(state, path)
print(json.dumps({"rise": host_peak_bytes() - before, "size": os.path.getsize(path),
                  "loads": bool(torch.equal(torch.load(path)["state_dict"]["w"], state["state_dict"]["w"]))}))
"""


@LINUX_ONLY
def test_writing_a_checkpoint_holds_no_copy_of_it_in_memory():
    """The checkpoint is streamed to its file: the resident set rises by a fraction of its size, where
    Lightning's `_atomic_save` held it twice in memory (an in-memory buffer, then a copy of it)."""
    out = _fresh(CHECKPOINT_PROBE)
    assert out["loads"] and out["size"] > 199e6
    assert out["rise"] < 0.25 * out["size"], (
        f"{out['rise'] / 1e6:.0f} MB for a {out['size'] / 1e6:.0f} MB file"
    )
