"""The default run over the CPUs it may meet: kernel capabilities x warm-start seeds x RL seeds.

    python scripts/research/cpu_grid.py [--capabilities avx512,avx2,default] [--ws-seeds 5] [--rl-seeds 1,2]
                               [--out outputs/cpu_grid] [hydra overrides ...]

torch picks its CPU kernels by the widest vector extension the CPU has; `ATEN_CPU_CAPABILITY` lowers
that choice, and reproduces another CPU's ATen kernels (an AVX2-only EPYC's default run was matched
to the last digit on an AVX-512 machine this way; a 400-step `experiment=tiny_long_sums` warm start of
another 2-core machine was not: docs/how-to/tools.md). Floating-point summation order then
differs, so each capability warm-starts and trains its own tiny model: each gets its own model cache
(`<out>/cache/<capability>`; the cache key names the settings, not the machine).

For each capability the script runs two Hydra multiruns in a subprocess with `ATEN_CPU_CAPABILITY`
set: warm-start seeds 0..N-1 with RL seed 0, and RL seeds `--rl-seeds` on warm-start seed 0. Every
run is the default command (`python src/train.py`) with `val_pass_k=0` (held-out greedy accuracy is
what is compared) and no checkpoints or export. It prints a markdown table (start, best and final
held-out greedy accuracy, gain, the warm start's SFT steps and probe accuracy, wall time) and writes
`<out>/table.md` and `<out>/table.json`. The exit status is 1 when a run misses the bar (`--gain`,
`--final`). oneDNN's bf16 kernels ignore `ATEN_CPU_CAPABILITY` (`ONEDNN_MAX_CPU_ISA` hides them); the
tiny model runs in float32 and does not use them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from loorl.research.ablation import read_jobs  # noqa: E402
from loorl.util.hardware import cpu_model  # noqa: E402

ORDER = ("default", "avx2", "avx512")  # ATEN_CPU_CAPABILITY values, narrowest first
FIXED = ["val_pass_k=0", "checkpoint_every=0", "export_policy=false", "trainer.enable_progress_bar=false"]


@functools.cache
def native_capability() -> str:
    """The widest capability this CPU runs (torch's own choice, without ATEN_CPU_CAPABILITY)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip().lower()


def cpu_name() -> str:
    """The CPU model and its widest torch capability, e.g. 'AMD EPYC (AVX512)'."""
    return f"{cpu_model()} ({native_capability().upper()})"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--capabilities",
        default=None,
        help="comma-separated ATEN_CPU_CAPABILITY values (default: every one this CPU runs)",
    )
    parser.add_argument(
        "--ws-seeds", type=int, default=5, help="warm-start seeds 0..N-1, RL seed 0 (default 5)"
    )
    parser.add_argument(
        "--rl-seeds", default="1,2", help="RL seeds on warm-start seed 0 (default 1,2; '' for none)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "cpu_grid", help="output folder")
    parser.add_argument(
        "--gain", type=float, default=0.25, help="the bar: held-out accuracy gain (default 0.25)"
    )
    parser.add_argument(
        "--final", type=float, default=0.90, help="the bar: final held-out accuracy (default 0.90)"
    )
    parser.add_argument("--table-only", action="store_true", help="tabulate the runs already under --out")
    args, overrides = parser.parse_known_args(argv)  # fmt: skip
    if any(o.startswith("-") for o in overrides):
        parser.error(
            f"unknown option {next(o for o in overrides if o.startswith('-'))}; Hydra overrides are key=value"
        )
    return args, overrides


def capabilities(requested: str | None) -> list[str]:
    native = ORDER.index(native_capability())
    if requested is None:
        return list(ORDER[: native + 1])[::-1]
    caps = [c.strip().lower() for c in requested.split(",") if c.strip()]
    for cap in caps:
        if cap not in ORDER:
            raise SystemExit(f"error: --capabilities: unknown {cap!r}; choose from {', '.join(ORDER)}")
        if ORDER.index(cap) > native:
            raise SystemExit(f"error: --capabilities: this CPU runs at most {ORDER[native]}, not {cap}")
    return caps


def run_sweeps(cap: str, args, overrides: list[str]) -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "LOORL_CACHE": str(args.out / "cache" / cap)}
    sweeps = [("ws", [f"model.tiny.warm_start.seed={','.join(map(str, range(args.ws_seeds)))}", "seed=0"])]
    if args.rl_seeds:
        sweeps.append(("rl", [f"seed={args.rl_seeds}", "model.tiny.warm_start.seed=0"]))
    for name, sweep in sweeps:
        folder = args.out / "runs" / cap / name
        cmd = [sys.executable, str(ROOT / "src" / "train.py"), "-m", f"hydra.sweep.dir={folder}",
               *FIXED, *sweep, *overrides]  # fmt: skip
        print(f"[{cap}] {' '.join(cmd[1:])}", flush=True)
        log = folder.parent / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            if subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"error: the {cap} {name} sweep failed; see {log}")


def warm_start_record(config: dict) -> dict:
    """warm_start.json of the job's tiny model (its cache folder, from the resolved config)."""
    from omegaconf import OmegaConf

    from loorl.models.tiny import tiny_model_dir

    cfg = OmegaConf.create(config)
    path = tiny_model_dir(cfg.model, cfg.task) / "warm_start.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def collect(args, caps: list[str]) -> list[dict]:
    rows = []
    for cap in caps:
        jobs, _ = read_jobs([args.out / "runs" / cap / name for name in ("ws", "rl")
                             if (args.out / "runs" / cap / name).is_dir()])  # fmt: skip
        for job in jobs:
            acc = job.series("val/accuracy")[1]
            ws = warm_start_record(job.config)
            rows.append({
                "capability": cap,
                "ws_seed": int(job.config["model"]["tiny"]["warm_start"]["seed"]),
                "rl_seed": int(job.config["seed"]),
                "ws_steps": ws.get("steps"),
                "ws_probe": ws.get("probe_accuracy"),
                "start": float(acc[0]), "best": float(acc.max()), "final": float(acc[-1]),
                "wall_seconds": float(job.summary["wall_seconds"]),
            })  # fmt: skip
    rows.sort(key=lambda r: (caps.index(r["capability"]), r["ws_seed"], r["rl_seed"]))
    return rows


def meets(row: dict, args) -> bool:
    """The bar: at least `--gain` held-out accuracy gained and at least `--final` at the end."""
    return row["final"] - row["start"] >= args.gain - 1e-9 and row["final"] >= args.final - 1e-9


def markdown(rows: list[dict], args, cpu: str, overrides: list[str]) -> str:
    lines = [
        f"CPU: {cpu}. Overrides: {' '.join(overrides) or '(none: the default run)'}.",
        "",
        "| capability | warm-start seed | RL seed | warm start (SFT steps, probe) | start | best | final "
        "| gain | wall (s) | bar |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        probe = f"{100 * r['ws_probe']:.1f}%" if r["ws_probe"] is not None else "no target"
        ws = f"{r['ws_steps']}, {probe}" if r["ws_steps"] is not None else "n/a"
        lines.append(
            f"| {r['capability']} | {r['ws_seed']} | {r['rl_seed']} | {ws} | {100 * r['start']:.1f}% | "
            f"{100 * r['best']:.1f}% | {100 * r['final']:.1f}% | {100 * (r['final'] - r['start']):+.1f} | "
            f"{r['wall_seconds']:.1f} | {'yes' if meets(r, args) else '**no**'} |"
        )
    if rows:

        def span(key, scale=100.0, fmt=".1f"):
            values = [scale * r[key] for r in rows]
            return f"{min(values):{fmt}} to {max(values):{fmt}}"

        gains = [100 * (r["final"] - r["start"]) for r in rows]
        passed = sum(meets(r, args) for r in rows)
        lines += ["", f"{passed} of {len(rows)} runs gain at least {100 * args.gain:.0f} points and "
                      f"end at {100 * args.final:.0f}% or more. Ranges: start {span('start')}%, final "
                      f"{span('final')}%, gain {min(gains):+.1f} to {max(gains):+.1f}, best minus final "
                      f"{min(100 * (r['best'] - r['final']) for r in rows):.1f} to "
                      f"{max(100 * (r['best'] - r['final']) for r in rows):.1f} points, wall "
                      f"{span('wall_seconds', 1.0)} s."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    caps = capabilities(args.capabilities)
    cpu = cpu_name()
    started = time.perf_counter()
    if not args.table_only:
        for cap in caps:
            run_sweeps(cap, args, overrides)
    rows = collect(args, caps)
    table = markdown(rows, args, cpu, overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table)
    (args.out / "table.json").write_text(
        json.dumps({"cpu": cpu, "overrides": overrides, "runs": rows}, indent=1)
    )
    print(
        table + f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s; written to {args.out}/table.md"
    )
    return 0 if rows and all(meets(r, args) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
