"""What an environment costs, and what its failures do to a run, in each `environment.isolation`.

    python scripts/bench/bench_environments.py calls        # a call and a session, process against thread
    python scripts/bench/bench_environments.py failures     # each failure kind against each mode, in a run

`calls`: the worked example's `calculate` (examples/environments/sum_calculator.py) called through
`Session.call` (the JSON parsed and checked, the method run, the result clipped), median microseconds
of `--calls` calls; and a sample's session (built, reset, closed) when its worker is new (forked) and
when it is reused, median over `--sessions`.

`failures`: the quick run (`debug=quick`, the tiny model, 8 steps, B=8 K=4) with the test environment
`FailOnce` (tests/plugins/environments.py), whose `reset` fails once in the run, in the first training
step (after validation's 80 resets), in one way: spins forever (hang), exits the process with status 3
(exit), dereferences NULL (segfault) or allocates 4 GB and keeps it (memory). For each mode: the run's
exit, the median step time of steps 2-7 (after the failure), the trainer's peak resident memory (the
summary's `peak_host_gib`), and the failure's counts; a clean run of each mode beside them. Prints a
markdown table and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("hang", "exit", "segfault", "memory")
MODES = ("process", "thread")


def bench_calls(calls: int, sessions: int) -> list[str]:
    sys.path.insert(0, str(ROOT / "examples" / "environments"))
    from sum_calculator import SumCalculatorEnv

    from loorl.tools.environment import Environment

    text = '{"name": "calculate", "arguments": {"expression": "123+456+789+101"}}'
    rows = ["| isolation | a call (us) | a session, new worker (ms) | a session, reused worker (ms) |",
            "| --- | --- | --- | --- |"]  # fmt: skip
    for mode in MODES:
        env = Environment(SumCalculatorEnv, timeout_s=5.0, max_result_chars=200, isolation=mode)
        session = env.session({"answer": "1469"}, 0)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            assert session.call(text).result == "1469"
            times.append(time.perf_counter() - start)
        session.close()
        per_session = {}
        for kind in ("new", "reused"):  # the first batch forks a worker per session, the second reuses them
            spans = []
            opened = []
            for i in range(sessions):
                start = time.perf_counter()
                opened.append(env.session({"answer": "1469"}, i))
                spans.append(time.perf_counter() - start)
            for s in opened:
                start = time.perf_counter()
                s.close()
                spans[opened.index(s)] += time.perf_counter() - start
            per_session[kind] = statistics.median(spans)
        env.close()
        rows.append(f"| {mode} | {1e6 * statistics.median(times):.0f} | {1e3 * per_session['new']:.2f} | "
                    f"{1e3 * per_session['reused']:.2f} |")  # fmt: skip
    return rows


def run_once(mode: str, kind: str | None, cache: Path, out: Path) -> dict:
    run = out / f"{mode}-{kind or 'clean'}"
    folder = Path(tempfile.mkdtemp(prefix="fail-once-"))
    cmd = [
        sys.executable,
        str(ROOT / "src" / "train.py"),
        "debug=quick",
        "rollout=hf",
        "trainer.accelerator=cpu",
        f"model.cache_dir={cache}",
        "environment._target_=plugins.environments.FailOnce",
        "tools.max_turns=1",
        "tools.timeout_s=1",
        "environment.memory_mb=512",
        "task.eval_size=16",
        "rl.steps=8",
        "checkpoint_every=0",
        "val_every=8",
        "rollout.max_new_tokens=32",  # steps long enough to time (the quick profile's are ~0.06 s)
        f"environment.isolation={mode}",
        f"hydra.run.dir={run}",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
        "LOORL_FAIL_ONCE": kind or "",
        "LOORL_FAIL_ONCE_DIR": str(folder),
        "LOORL_FAIL_AFTER": "100",  # validation's 16 prompts x (1 greedy + 4 sampled) pass first
    }
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    row = {
        "mode": mode,
        "kind": kind or "none",
        "exit": done.returncode,
        "seconds": time.perf_counter() - start,
    }
    if done.returncode != 0 or not (run / "metrics.json").exists():
        row["what"] = f"the run died (exit {done.returncode})"
        return row
    metrics = json.loads((run / "metrics.json").read_text())
    history = metrics["history"]
    steps = [v for s, v in history["perf/step_seconds"] if s >= 2]
    counts = {k.removeprefix("tools/"): sum(v for _, v in history.get(k, [])) for k in
              ("tools/env_reset_failures", "tools/env_workers_lost")}  # fmt: skip
    row |= {"step_s": statistics.median(steps), "peak_gib": metrics["summary"]["peak_host_gib"], **counts,
            "what": "finished"}  # fmt: skip
    return row


def bench_failures(cache: Path, out: Path) -> list[str]:
    results = [run_once(mode, kind, cache, out) for mode in MODES for kind in (None, *KINDS)]
    (out / "failures.json").write_text(json.dumps(results, indent=1))
    rows = ["| isolation | failure (in reset, once) | the run | step after (s, median) | trainer peak (GiB) "
            "| reset failures | workers lost |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in results:
        if r["what"] == "finished":
            rows.append(f"| {r['mode']} | {r['kind']} | finished | {r['step_s']:.2f} | {r['peak_gib']:.2f} | "
                        f"{r['env_reset_failures']:.0f} | {r['env_workers_lost']:.0f} |")  # fmt: skip
        else:
            rows.append(f"| {r['mode']} | {r['kind']} | {r['what']} | - | - | - | - |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("calls", "failures"))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "loorl-bench-cache")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "environments")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = (
        bench_calls(args.calls, args.sessions)
        if args.what == "calls"
        else bench_failures(args.cache, args.out)
    )
    table = "\n".join(rows)
    print(table)
    (args.out / f"{args.what}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
