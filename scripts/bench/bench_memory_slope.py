"""Does a long run's memory stay flat? Runs training for many steps and checks the per-step peak's
slope after warm-up; writes outputs/bench/memory_slope.md (and .json).

    python scripts/bench/bench_memory_slope.py                                   # tiny default, 300 steps
    python scripts/bench/bench_memory_slope.py --steps 200 -- experiment=smollm2_arithmetic
    python scripts/bench/bench_memory_slope.py --steps 100 -- experiment=smollm2_arithmetic \
        trim_freed_memory_every=0                                          # the climb untrimmed

The run is a fresh `python src/train.py` process (memory is a property of the whole process), with
validation and the export off; its own outputs (summary.md, metrics) go to <out>/memory_slope_run.
A step's peak is the largest `perf/<phase>_peak_host_gib` the step logged (the kernel's high-water
mark of the resident set, restarted at each phase boundary: `loorl.util.peak_memory`). After
`--warmup` steps (the weights page in, AdamW's state appears, the allocator finds its working set)
the script reports:

- the least-squares slope of the step peaks, in GiB per 100 steps;
- the peaks' maximum in each of `--windows` equal windows: trimming freed memory every N steps
  (`trim_freed_memory_every`) makes a saw-tooth, whose windows' maxima stay level where the run
  does not climb.

It exits 1 when the slope exceeds `--max-slope` GiB per 100 steps (default 0.05, about 1% of
SmolLM2's recipe per 100 steps), so a CI job or a bisect can use it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXED = ["val_every=100000", "export_policy=false", "+trainer.limit_val_batches=0"]  # training steps only


def step_peaks(history: dict[str, list[list[float]]]) -> dict[int, float]:
    """Step -> the largest host peak any phase of that step logged (GiB), from metrics.json's history
    ({metric: [[step, value], ...]})."""
    peaks: dict[int, float] = {}
    for name, points in history.items():
        if name.startswith("perf/") and name.endswith("_peak_host_gib"):
            for step, value in points:
                peaks[int(step)] = max(peaks.get(int(step), 0.0), float(value))
    return peaks


def slope_per_100(steps: list[int], values: list[float]) -> float:
    """Least-squares slope of `values` over `steps`, in units per 100 steps (0 for fewer than 2)."""
    n = len(steps)
    if n < 2:
        return 0.0
    mean_x, mean_y = sum(steps) / n, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in steps)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values))
    return 100.0 * sxy / sxx if sxx else 0.0


def window_maxima(values: list[float], windows: int) -> list[float]:
    """The maximum of each of `windows` consecutive, as equal as possible, slices of `values`."""
    windows = max(1, min(windows, len(values)))
    bounds = [round(i * len(values) / windows) for i in range(windows + 1)]
    return [max(values[a:b]) for a, b in zip(bounds, bounds[1:])]


def summarise(peaks: dict[int, float], warmup: int, windows: int) -> dict:
    """The after-warm-up figures of one run's step peaks."""
    steps = sorted(s for s in peaks if s >= warmup)
    values = [peaks[s] for s in steps]
    if len(values) < 2:
        raise SystemExit(f"--warmup {warmup}: only {len(values)} steps after it; run more --steps")
    return {
        "steps": len(values),
        "first_step": steps[0],
        "last_step": steps[-1],
        "slope_gib_per_100": slope_per_100(steps, values),
        "window_max_gib": window_maxima(values, windows),
        "peak_gib": max(values),
        "warmup_peak_gib": max([peaks[s] for s in peaks if s < warmup], default=float("nan")),
    }


def run(overrides: list[str], steps: int, out: Path) -> dict:
    """One fresh training process; its metrics.json history."""
    cmd = [sys.executable, "src/train.py", *overrides, f"rl.steps={steps}", *FIXED, f"hydra.run.dir={out}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((out / "metrics.json").read_text())["history"]


def report(result: dict, overrides: list[str], max_slope: float, flat: bool) -> str:
    verdict = "flat" if flat else "CLIMBS"
    maxima = " / ".join(f"{v:.2f}" for v in result["window_max_gib"])
    return "\n".join(
        [
            f"# Memory over a long run: {verdict}",
            "",
            f"`python src/train.py {' '.join(overrides)}`, steps {result['first_step']}-{result['last_step']}"
            " (after warm-up)",
            "",
            "| slope (GiB / 100 steps) | window maxima (GiB) | peak after warm-up (GiB) "
            "| peak in warm-up (GiB) |",
            "| --- | --- | --- | --- |",
            f"| {result['slope_gib_per_100']:+.3f} (limit {max_slope}) | {maxima} | {result['peak_gib']:.2f} "
            f"| {result['warmup_peak_gib']:.2f} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="RL steps of the run")
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the slope")
    p.add_argument("--windows", type=int, default=5, help="windows whose maxima are reported")
    p.add_argument("--max-slope", type=float, default=0.05, help="GiB per 100 steps above which it exits 1")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench", help="where the report goes")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args(argv)
    if args.warmup >= args.steps - 1:
        p.error(f"--warmup {args.warmup} leaves no slope in --steps {args.steps}: lower --warmup")
    history = run(args.overrides, args.steps, args.out / "memory_slope_run")  # its summary.md stays there
    result = summarise(step_peaks(history), args.warmup, args.windows)
    flat = result["slope_gib_per_100"] <= args.max_slope
    text = report(result, args.overrides, args.max_slope, flat)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_slope.md").write_text(text + "\n")
    (args.out / "memory_slope.json").write_text(json.dumps({"overrides": args.overrides, **result}, indent=1))
    print(text)
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
