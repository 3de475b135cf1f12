"""scripts/research/cpu_grid.py: the default run under each CPU kernel capability, in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "research" / "cpu_grid.py"


def _grid(out: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.slow  # a research script's grid, two warm starts: on request, beside the whole grid
def test_each_capability_trains_under_its_own_kernels_and_cache(tmp_path):
    """Two capabilities, a few steps each: the warm start of each ran with that capability's kernels
    (its record says so), in its own cache, and the table has one row per run."""
    done = _grid(tmp_path, "--capabilities", "default,avx2", "--ws-seeds", "1", "--rl-seeds", "",
                 "rl.steps=2", "val_every=2", "model.tiny.warm_start.max_steps=10",
                 "model.tiny.warm_start.target_accuracy=null", timeout=600)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]  # 2 steps do not clear the bar: exit status 1
    table = json.loads((tmp_path / "table.json").read_text())
    assert [(r["capability"], r["ws_seed"], r["rl_seed"]) for r in table["runs"]] == [
        ("default", 0, 0), ("avx2", 0, 0)]  # fmt: skip
    records = {cap: json.loads(next((tmp_path / "cache" / cap).glob("tiny-*/warm_start.json")).read_text())
               for cap in ("default", "avx2")}  # fmt: skip
    assert {cap: r["cpu_capability"] for cap, r in records.items()} == {"default": "DEFAULT", "avx2": "AVX2"}
    assert records["default"]["loss"] != records["avx2"]["loss"]  # other kernels, other float results
    assert "| default | 0 | 0 | 10, no target |" in done.stdout and "0 of 2 runs" in done.stdout


def test_unknown_capability_is_one_line():
    done = _grid(Path("/nonexistent"), "--capabilities", "avx1024", timeout=60)
    assert done.returncode != 0 and "unknown 'avx1024'" in done.stderr


@pytest.mark.slow
def test_the_whole_grid_clears_the_bar(tmp_path):
    """Every capability this CPU runs x warm-start seeds 0..4 x RL seeds 0..2 (about 30 min on 2 cores):
    +25 points and at least 90% at the end, every run."""
    done = _grid(tmp_path, timeout=5400)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
