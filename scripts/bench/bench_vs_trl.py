"""loorl against TRL's `RLOOTrainer` on the same work; writes outputs/bench/vs_trl.md (and .json).

    python scripts/bench/bench_vs_trl.py                         # tiny default and SmolLM2-135M, 3 runs each
    python scripts/bench/bench_vs_trl.py --work tiny --repeats 5
    python scripts/bench/bench_vs_trl.py --work smollm2 --steps 5
    python scripts/bench/bench_vs_trl.py --work recipe --paired-seeds   # the SmolLM2 recipe, seeds 0, 1, 2

Same model files, prompts (each step's B prompts drawn by loorl's task and fed to TRL in order), K,
learning rate and AdamW settings, new-token limit, sampler, clipping, KL coefficient, precision and
step count: TRL's side (`scripts/peers/trl_rloo.py`) is built from the loorl config the same overrides
compose. Runs alternate, loorl then TRL, `--repeats` times (A B A B: drift of the machine hits both).

Per run: the whole process's wall time, the median seconds per RL step (rollout + update; the first
steps' one-off costs fall out of the median), generation tokens/s (sampled tokens over sampling
time), training tokens/s (prompt + completion tokens of the step's rows over the step's time outside
the rollout), the process tree's peak resident memory (sampled every 50 ms, and the kernel's
ru_maxrss), and the held-out greedy accuracy of the final policy, scored for both systems by the same
function (`src/eval.py` on the exported policy: the task's held-out set, loorl's verifier). The table
reports medians over the runs of each system.

TRL needs accelerate, which loorl's environment keeps out; the first run creates a venv at
`--venv` (default <LOORL_CACHE>/trl-venv) that sees this environment's packages (torch,
transformers: the same versions for both) and adds trl==1.16.0, accelerate and datasets from the
package index. Offline (a GPU node without an index), `--trl-python PATH` names an interpreter that
already has them (and loorl's own dependencies, since scripts/peers/trl_rloo.py composes loorl's config):
no venv is made and nothing is installed; a path that is missing or cannot `import trl, accelerate,
datasets` is refused in one line before any run starts. On a GPU node both systems run on CUDA
(loorl's accelerator=auto, TRL's use_cpu off): untested on GPU, as is `--trl-python` there. loorl
runs as configured (its step-0 and final validations and policy export included in its whole-process
time; TRL evaluates nothing while training).

A finished run's row is kept beside its log (`vs_trl_runs/<work>-<system>-<i>.row.json`), and a later
invocation with the same overrides takes it instead of running again: a comparison stopped after seed 0
(Ctrl-C) continues with seed 1, and the table holds every run. A run cut short starts again from scratch.

    python scripts/bench/bench_vs_trl.py --trl-python /opt/trl-env/bin/python   # offline: TRL already there
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from loorl.util.hardware import cuda_available, machine_line  # the CPU, kernels, bf16 units, GPUs, torch

ROOT = Path(__file__).resolve().parents[2]
TRL_REQUIREMENTS = ["trl==1.16.0", "accelerate", "datasets"]
TRL_MODULES = ["trl", "accelerate", "datasets"]  # what --trl-python must import
PROBE_S = 300  # the import check's limit (TRL imports transformers, accelerate and datasets)

# the work: loorl overrides (TRL's run is composed from the same ones) and the default step count
WORK = {
    # the default run: tiny model, 96 prompts x K=4, 5 new tokens, lr 3e-4 cosine, temperature 0.7; the HF
    # engine as on CPU (rollout=auto would take vLLM on a GPU node that has it, TRL samples with `generate`)
    "tiny": {"overrides": ["rollout=hf"], "steps": 150},
    # SmolLM2-135M-Instruct on chat arithmetic: 8 prompts x K=4 (its recipe), 24 new tokens, lr 1e-5,
    # bf16 compute over float32 weights for both (TRL: bf16=True); 10 steps (a TRL step is ~40 s)
    "smollm2": {
        "overrides": [
            "model=smollm2_135m",
            "task=chat_arithmetic",
            "rollout=hf",
            "rollout.max_new_tokens=24",
            "optimizer.lr=1e-5",
            "model.dtype=bfloat16",
        ],
        "steps": 10,
    },
    # the SmolLM2 arithmetic recipe as shipped (16 prompts x K=4, 32 new tokens, lr 2e-5 cosine,
    # temperature 0.7, bf16 autocast where the CPU has bf16 units); 15 steps (a TRL step is ~40 s);
    # run with --paired-seeds for the accuracy comparison: run i of both systems is seed i
    "recipe": {"overrides": ["experiment=smollm2_arithmetic", "rollout=hf"], "steps": 15},
}
LOORL_RUN = ["trainer.enable_progress_bar=false", "checkpoint_every=0", "val_pass_k=0"]


def cache_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get("LOORL_CACHE", "~/.cache/loorl")))


def ensure_trl_venv(venv: Path) -> Path:
    """The venv's interpreter; the venv is created (and TRL pip-installed into it) on first use."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"creating the TRL venv {venv} ({', '.join(TRL_REQUIREMENTS)} over this environment)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_REQUIREMENTS], check=True)
    return python


def checked_trl_python(path: str) -> Path:
    """`--trl-python`: an interpreter (a path, or a command on PATH) that imports TRL's packages.

    Raises ValueError with a one-line message naming the option and the fix."""
    found = shutil.which(path) if os.sep not in path else path
    fix = f"point it at an interpreter with {', '.join(TRL_REQUIREMENTS)}, or leave it out to create a venv"
    if found is None or not (Path(found).is_file() and os.access(found, os.X_OK)):
        raise ValueError(f"--trl-python={path} is not an executable file: {fix}")
    modules = ", ".join(TRL_MODULES)
    try:
        probe = subprocess.run(
            [found, "-c", f"import {modules}"], capture_output=True, text=True, timeout=PROBE_S
        )
        failure = (probe.stderr or f"exit {probe.returncode}") if probe.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = str(err)
    if failure:
        last = failure.strip().splitlines()[-1]
        raise ValueError(f"--trl-python={path} cannot import {modules} ({last}): {fix}")
    return Path(found)


def trl_interpreter(*, trl_python: str | None, venv: Path, systems: list[str]) -> Path:
    """The interpreter that runs TRL's side: `--trl-python` as given (checked, nothing installed), else
    the venv (created on first use); this one when TRL is not benchmarked."""
    if "trl" not in systems:
        return Path(sys.executable)
    if trl_python is not None:
        return checked_trl_python(trl_python)
    return ensure_trl_venv(venv)


class PeakMemory:
    """The peak of the summed resident memory of a process and its descendants, sampled."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            total = 0
            for pid in self._tree():
                try:
                    total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
                except (OSError, IndexError, ValueError):
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def timed(cmd: list[str], log: Path) -> tuple[float, int]:
    """Run `cmd` (output to `log`); its wall seconds and peak resident bytes. Fails loudly."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        memory = PeakMemory(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    peak = max(memory.stop(), usage.ru_maxrss * 1024)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); see {log}")
    return seconds, peak


def loorl_step_metrics(run: Path) -> dict[str, float]:
    import csv

    rows = [r for r in csv.DictReader(open(run / "csv" / "metrics.csv")) if r.get("perf/step_seconds")]

    def col(key):
        return [float(r[key]) for r in rows]

    rollout = [g + s + p for g, s, p in zip(col("perf/gen_seconds"), col("perf/grade_seconds"),
                                            col("perf/prepare_seconds"))]  # fmt: skip
    return {
        "step_s": statistics.median(col("perf/step_seconds")),
        "gen_tok_s": sum(col("rollout/gen_tokens")) / sum(col("perf/gen_seconds")),
        "train_tok_s": sum(col("perf/train_tokens"))
        / sum(s - r for s, r in zip(col("perf/step_seconds"), rollout)),
    }


def trl_step_metrics(run: Path) -> dict[str, float]:
    t = json.loads((run / "trl_metrics.json").read_text())["timing"]
    # TRL's scoring (reward, advantages) is a small part of the step outside `generate`
    return {
        "step_s": statistics.median(t["step"]),
        "gen_tok_s": sum(t["gen_tokens"]) / sum(t["gen"]),
        "train_tok_s": sum(t["train_tokens"]) / sum(s - g for s, g in zip(t["step"], t["gen"])),
    }


def held_out_accuracy(policy: Path, overrides: list[str], out: Path) -> float:
    """The same scorer for both systems: loorl's evaluation of the exported policy (greedy, held-out)."""
    cmd = [sys.executable, "src/eval.py", f"policy={policy}", *overrides, "eval.samples=0", "eval.rows=0",
           f"hydra.run.dir={out}", "trainer.enable_progress_bar=false"]  # fmt: skip
    timed(cmd, out.with_suffix(".log"))
    return float(json.loads((out / "results.json").read_text())["metrics"]["pass@1_greedy"])


def run_once(
    system: str, work: str, steps: int, index: int, out: Path, trl_python: Path, *, paired_seeds: bool = False
) -> dict:
    overrides = [*WORK[work]["overrides"], f"rl.steps={steps}", *([f"seed={index}"] if paired_seeds else [])]
    run = out / f"{work}-{system}-{index}"
    kept = out / f"{run.name}.row.json"  # the finished run's row: a later invocation takes it as it is
    if kept.is_file() and (row := json.loads(kept.read_text())).get("overrides") == overrides:
        print(f"{run.name}: finished before, its row kept ({kept})", flush=True)
        return row
    shutil.rmtree(run, ignore_errors=True)  # a run cut short: its files would mix into this one's
    if system == "loorl":
        cmd = [sys.executable, "src/train.py", *overrides, *LOORL_RUN, f"val_every={steps}",
               f"hydra.run.dir={run}"]  # fmt: skip
    else:
        cmd = [str(trl_python), "scripts/peers/trl_rloo.py", "--out", str(run), *overrides]
    seconds, peak = timed(cmd, out / f"{run.name}.log")
    metrics = (loorl_step_metrics if system == "loorl" else trl_step_metrics)(run)
    accuracy = held_out_accuracy(run / "policy", WORK[work]["overrides"], out / f"{run.name}-eval")
    row = {"system": system, "work": work, "run": index, "seed": index if paired_seeds else None,
           "process_s": seconds, "peak_mib": peak / 2**20, "accuracy": accuracy, **metrics,
           "overrides": overrides}  # fmt: skip
    kept.write_text(json.dumps(row, indent=1))
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], steps: dict[str, int], repeats: int) -> str:
    lines = [
        f"## loorl vs TRL 1.16 `RLOOTrainer` (medians over {repeats} alternating runs each)",
        "",
        "| work | system | whole process (s) | s / step | gen tokens/s | train tokens/s | peak RSS (MiB) "
        "| held-out accuracy | speed-up (process, step) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = ("process_s", "step_s", "gen_tok_s", "train_tok_s", "peak_mib", "accuracy")
    for work in steps:
        med = {}
        for system in ("trl", "loorl"):
            mine = [r for r in rows if r["work"] == work and r["system"] == system]
            if mine:
                med[system] = {k: statistics.median(r[k] for r in mine) for k in keys}
        for system, m in med.items():
            speedup = ""
            if system == "loorl" and "trl" in med:
                t = med["trl"]
                speedup = f"{t['process_s'] / m['process_s']:.2f}x, {t['step_s'] / m['step_s']:.2f}x"
            lines.append(
                f"| {work} ({steps[work]} steps) | {system} | {m['process_s']:.1f} | {m['step_s']:.2f} "
                f"| {m['gen_tok_s']:.0f} | {m['train_tok_s']:.0f} | {m['peak_mib']:.0f} "
                f"| {100 * m['accuracy']:.1f}% | {speedup} |"
            )
    return "\n".join(lines) + "\n"


def paired_table(rows: list[dict]) -> str:
    """Per seed, both systems' held-out accuracy and their difference (the same prompts, K and steps:
    the same number of generated samples), and the mean difference."""
    lines = ["", "Paired seeds (run i of both systems trained with seed i):", "",
             "| work | seed | loorl | TRL | loorl - TRL (points) | loorl s / TRL s (process) |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    diffs = []
    for row in rows:
        if row["system"] != "loorl":
            continue
        peer = next(
            (r for r in rows if r["system"] == "trl" and (r["work"], r["run"]) == (row["work"], row["run"])),
            None,
        )
        if peer is None:
            continue
        diff = 100 * (row["accuracy"] - peer["accuracy"])
        diffs.append(diff)
        lines.append(
            f"| {row['work']} | {row['seed']} | {100 * row['accuracy']:.1f}% | {100 * peer['accuracy']:.1f}% "
            f"| {diff:+.1f} | {row['process_s'] / peer['process_s']:.2f} |"
        )
    if diffs:
        lines += ["", f"Mean difference over {len(diffs)} seed(s): {statistics.fmean(diffs):+.1f} points."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", nargs="+", choices=sorted(WORK), default=["tiny", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system per work (at least 3)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: per work)")
    parser.add_argument("--systems", nargs="+", choices=["loorl", "trl"], default=["loorl", "trl"])
    parser.add_argument(
        "--paired-seeds",
        action="store_true",
        help="run i of both systems trains with seed=i (accuracy over seeds, not one seed's noise)",
    )
    parser.add_argument(
        "--venv", type=Path, default=cache_dir() / "trl-venv", help="made for TRL without --trl-python"
    )
    parser.add_argument(
        "--trl-python",
        metavar="PATH",
        help="an interpreter that already has trl, accelerate and datasets (offline: no venv, no pip)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    try:  # before any run: a bad interpreter is one line, not a failure 20 minutes in
        trl_python = trl_interpreter(trl_python=args.trl_python, venv=args.venv, systems=args.systems)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    out = args.out.resolve() / "vs_trl_runs"
    out.mkdir(parents=True, exist_ok=True)
    steps = {w: args.steps or WORK[w]["steps"] for w in args.work}
    rows = []
    for work in args.work:
        for index in range(args.repeats):
            for system in args.systems:  # alternating: A B A B
                rows.append(
                    run_once(
                        system, work, steps[work], index, out, trl_python, paired_seeds=args.paired_seeds
                    )
                )
    text = table(rows, steps, args.repeats) + (paired_table(rows) if args.paired_seeds else "")
    text += (
        f"\nMachine: {machine_line(on_cuda=cuda_available())}. Command: "
        f"`python scripts/bench/bench_vs_trl.py {' '.join(sys.argv[1:])}`. Per-run rows: vs_trl.json.\n"
    )
    (args.out / "vs_trl.md").write_text(text)
    (args.out / "vs_trl.json").write_text(json.dumps(rows, indent=1))
    print("\n" + text + f"\nwritten to {args.out}/vs_trl.md")


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
