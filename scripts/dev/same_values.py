"""A refactor's check that behaviour did not change: the same runs from two checkouts, every non-timing
value of their metrics.json compared.

    python scripts/dev/same_values.py run OLD_CHECKOUT /tmp/sv/before   # the five runs, from that tree
    python scripts/dev/same_values.py run . /tmp/sv/after
    python scripts/dev/same_values.py compare /tmp/sv/before /tmp/sv/after

The runs: the default run, one step off (`rollout.max_staleness=1`), a run with its own vLLM server two
steps ahead (`rollout=vllm_server rollout.max_staleness=2`, quick profile, 4 steps), dynamic sampling
(`rl.dynamic_sampling.enabled=true`) and the quick study (`scripts/research/study.py quick`; older
checkouts keep it at `scripts/study.py`). About 8 minutes on 2 cores with the tiny model cached.
Timing and memory keys (perf/*, *_seconds, *_gib, ...) differ between any two runs and are left out;
NaN equals NaN. `compare` exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

RUNS = {  # name -> overrides of `python src/train.py`
    "default": [],
    "one_step_off": ["rollout.max_staleness=1"],
    "server": ["debug=quick", "rollout=vllm_server", "rollout.max_staleness=2", "rl.steps=4", "val_every=4"],
    "dynamic": ["rl.dynamic_sampling.enabled=true"],
}
# substrings of keys whose values are timings or memory, never the same twice, or the machine (metrics.json's
# facts: a checkout from before runs kept it has none)
TIMING = ("perf/", "seconds", "_s", "time", "wall", "memory", "peak", "rss", "tokens_per_s", "date", "_gb",
          "_gib", "rise_", "facts")  # fmt: skip


def run_all(checkout: Path, out: Path, port: int) -> None:
    """The five runs from `checkout`'s own src/, into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONPATH": str(checkout / "src")}  # that tree's loorl, not the installed one
    for name, overrides in RUNS.items():
        if name == "server":
            overrides = [*overrides, f"rollout.server.port={port}"]
        start = time.time()
        command = [sys.executable, "src/train.py", *overrides, f"hydra.run.dir={out / name}"]
        with open(out / f"{name}.log", "w") as log:
            done = subprocess.run(command, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"{name}: exit {done.returncode}, {time.time() - start:.0f} s", flush=True)
    study = next(
        p for p in (checkout / "scripts/research/study.py", checkout / "scripts/study.py") if p.exists()
    )
    shutil.rmtree(checkout / "outputs/studies/quick", ignore_errors=True)
    with open(out / "study.log", "w") as log:
        done = subprocess.run([sys.executable, str(study), "quick"], cwd=checkout, env=env, stdout=log,
                              stderr=subprocess.STDOUT)  # fmt: skip
    print(f"study: exit {done.returncode}", flush=True)
    shutil.copytree(checkout / "outputs/studies/quick", out / "study", dirs_exist_ok=True)


def without_timing(value):
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if not any(t in k for t in TIMING)}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def differences(a, b, path: str = "") -> list[str]:
    """Every place where `a` and `b` differ, as `path: a != b` lines."""
    if type(a) is not type(b):
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        out = [f"{path}/{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} values != {len(b)}"]
        return [line for i, (x, y) in enumerate(zip(a, b)) for line in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(a: Path, b: Path) -> int:
    """Prints one line a run (its key and value counts, SAME or how many differ); the count of differences."""
    total = 0
    for metrics_a in sorted(a.rglob("metrics.json")):
        relative = metrics_a.relative_to(a)
        metrics_b = b / relative
        if not metrics_b.exists():
            print(f"{relative}: missing in {b}")
            total += 1
            continue
        x = without_timing(json.loads(metrics_a.read_text()))
        y = without_timing(json.loads(metrics_b.read_text()))
        found = differences(x, y)
        total += len(found)
        values = sum(len(v) for v in x.get("history", {}).values()) + len(x.get("summary", {}))
        print(f"{relative}: {values} values, " + ("SAME" if not found else f"{len(found)} differ"))
        for line in found[:8]:
            print("   ", line)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the five runs from a checkout")
    run.add_argument("checkout", type=Path)
    run.add_argument("out", type=Path)
    run.add_argument("--port", type=int, default=18765, help="the run's own vLLM server's port")
    both = sub.add_parser("compare", help="two folders of runs, value by value")
    both.add_argument("a", type=Path)
    both.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run_all(args.checkout.resolve(), args.out.resolve(), args.port)
    else:
        sys.exit(1 if compare(args.a, args.b) else 0)


if __name__ == "__main__":
    main()
