"""Synchronous against one-step-off rollouts, side by side: the same runs, seeds and steps, timed whole.

    python scripts/bench/bench_async.py                                  # tiny default + SmolLM2, 3 seeds
    python scripts/bench/bench_async.py --models tiny --seeds 0 1 2 --modes sync async
    python scripts/bench/bench_async.py --smollm2-steps 20               # SmolLM2 runs shorter than its 60
    python scripts/bench/bench_async.py --models tiny --seeds 0 --modes sync vllm server0 server1 server2
                                  # the same work five ways (start the server first: scripts/cluster/serve.py
                                  # --port 8765 --host 127.0.0.1 rollout=vllm_server)

Each cell is `python src/train.py <model> seed=S rollout.max_staleness=A rollout.devices=D`, timed from
the process's start to its end (model load, validations and outputs included), once per seed; the
seed also seeds the tiny model's warm start (`model.tiny.warm_start.seed`), so each seed is another
model too. Modes: `sync` (max_staleness=0), `async` (one step off, the sampler in a process of its own on
half the cores: rollout.devices=auto), `async_inline` (one step off in the training process: the
schedule without the overlap). Before the timed runs, one untimed run per seed builds the caches
(the warm-started tiny model, SmolLM2's conversion). Writes `<out>/async.md` (the table) and each
run's folder under `<out>/runs/`.

Columns: s/step = whole-process wall time / RL steps; median step = the median of `perf/step_seconds`
(the steady state); tokens/s = generated tokens / whole-process wall time (the run's throughput);
sampler tokens/s = the sampler's own speed while it generates; held-out accuracy at the first and
last validation. Every column is mean +- the half-width of a 95% Student-t interval over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from loorl.research.ablation import mean_ci  # noqa: E402

MODELS = {  # name -> the run's overrides, given the steps
    "tiny": lambda steps, seed: [f"rl.steps={steps}", f"model.tiny.warm_start.seed={seed}"],
    "smollm2": lambda steps, seed: [
        "experiment=smollm2_arithmetic",
        f"rl.steps={steps}",
        f"val_every={steps}",
    ],
}
MODES = {
    "sync": ["rollout.max_staleness=0"],
    "async": ["rollout.max_staleness=1", "rollout.devices=auto"],
    "async_inline": ["rollout.max_staleness=1", "rollout.devices=trainer"],
    "vllm": ["rollout=vllm", "rollout.max_staleness=0"],  # vLLM in the training process
    # a vLLM server (--server-url, started beforehand: scripts/cluster/serve.py), N steps ahead
    "server0": ["rollout=vllm_server", "rollout.max_staleness=0"],
    "server1": ["rollout=vllm_server", "rollout.max_staleness=1"],
    "server2": ["rollout=vllm_server", "rollout.max_staleness=2"],
}


def run(overrides: list[str], folder: Path) -> float:
    """One training run; its whole-process wall time in seconds."""
    cmd = [sys.executable, str(ROOT / "src" / "train.py"), "trainer.accelerator=cpu",
           "trainer.enable_progress_bar=false",
           f"hydra.run.dir={folder}", *overrides]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (folder / "bench.log").parent.mkdir(parents=True, exist_ok=True)
    (folder / "bench.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return seconds


def cell(folder: Path, wall: float) -> dict[str, float]:
    metrics = json.loads((folder / "metrics.json").read_text())
    summary, history = metrics["summary"], metrics["history"]
    steps = summary["rl_steps"]
    sampler = [v for _, v in history.get("perf/gen_tokens_per_s", [])]
    step_seconds = [v for _, v in history.get("perf/step_seconds", [])]
    waits = [v for _, v in history.get("perf/gen_seconds", [])][1:]  # after the first step
    syncs = [v for _, v in history.get("perf/weight_sync_seconds", [])][1:]
    return {
        "gen_wait": statistics.median(waits) if waits else float("nan"),
        "weight_sync": statistics.median(syncs) if syncs else float("nan"),
        "s_per_step": wall / steps,
        "median_step": statistics.median(step_seconds) if step_seconds else float("nan"),
        "tokens_per_s": summary["gen_tokens"] / wall,
        "sampler_tokens_per_s": statistics.median(sampler) if sampler else float("nan"),
        "acc_start": summary["val_accuracy_start"],
        "acc_end": summary["val_accuracy_end"],
        "wall": wall,
    }


def fmt(values: list[float], spec: str, scale: float = 1.0) -> str:
    mean, half = mean_ci([v * scale for v in values])
    return f"{mean:{spec}}" + ("" if half != half else f" ± {half:{spec}}")


def table(results: dict, steps: dict[str, int], seeds: list[int], command: str) -> str:
    lines = [
        "## Synchronous vs one step off, 2 CPU cores",
        "",
        f"`{command}`: {len(seeds)} seeds ({', '.join(map(str, seeds))}), mean ± 95% t-interval.",
        "",
        "| model | steps | mode | s/step (whole process) | median step (s) | "
        "median wait for the rollout (s) | median weight update (s) | tokens/s (whole process) | "
        "sampler tokens/s | held-out accuracy, first -> last validation (%) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (model, mode), cells in results.items():
        col = {k: [c[k] for c in cells] for k in cells[0]}
        lines.append(
            f"| {model} | {steps[model]} | {mode} | {fmt(col['s_per_step'], '.3f')} | "
            f"{fmt(col['median_step'], '.3f')} | {fmt(col['gen_wait'], '.3f')} | "
            f"{fmt(col['weight_sync'], '.3f')} | "
            f"{fmt(col['tokens_per_s'], '.0f')} | {fmt(col['sampler_tokens_per_s'], '.0f')} | "
            f"{fmt(col['acc_start'], '.1f', 100)} -> {fmt(col['acc_end'], '.1f', 100)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=list(MODES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--tiny-steps", type=int, default=150)  # the default run's
    parser.add_argument("--smollm2-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_async")
    parser.add_argument("--server-url", default="http://127.0.0.1:8765",
                        help="the vLLM server of the server* modes (scripts/cluster/serve.py)")  # fmt: skip
    args = parser.parse_args()
    steps = {"tiny": args.tiny_steps, "smollm2": args.smollm2_steps}
    results: dict[tuple[str, str], list[dict]] = {}
    for model in args.models:
        for seed in args.seeds if model == "tiny" else args.seeds[:1]:  # caches first, untimed: the tiny
            # model's warm start (one per seed), SmolLM2's conversion (one)
            run(
                [*MODELS[model](1, seed), f"seed={seed}", "val_every=1"],
                args.out / "prepare" / f"{model}-{seed}",
            )
        for seed in args.seeds:
            for mode in args.modes:  # modes alternate within a seed, so drift spreads over all of them
                folder = args.out / "runs" / model / mode / f"seed{seed}"
                server = [f"rollout.server.urls=[{args.server_url}]"] if mode.startswith("server") else []
                wall = run(
                    [*MODELS[model](steps[model], seed), f"seed={seed}", *MODES[mode], *server], folder
                )
                results.setdefault((model, mode), []).append(cell(folder, wall))
                print(f"{model} {mode} seed {seed}: {wall:.1f} s", flush=True)
    command = "python scripts/bench/bench_async.py " + " ".join(sys.argv[1:])
    text = table(results, steps, args.seeds, command.strip())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
