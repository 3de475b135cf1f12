"""Run a named ablation as a Hydra multirun and turn it into an answer (docs/how-to/research.md).

    python scripts/research/ablate.py estimators --seeds 3 --steps 150 [hydra overrides ...]
    python scripts/research/ablate.py [title] --from outputs/multirun/2026-11-22/10-00-00 [more sweep folders]

The first runs `python src/train.py -m ablation=NAME seed=0,..,N-1 rl.steps=S` with its sweep folder
at `<out>/runs` (out: `outputs/ablations/NAME`), then writes `<out>/table.md` (each setting's final,
best and mean held-out accuracy, reward, KL, generated tokens and wall time: mean ± 95% CI over
seeds; a second table: the steps, generated tokens and RL-step seconds to reach 70% and 80%),
`<out>/table.json` and `<out>/curves.png`. `--from` reads finished multirun folders instead
(any sweep: settings are told apart by the overrides that differ between its jobs); the name is
then the table's title and the default output folder's name.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from loorl.config import CONF_DIR  # noqa: E402
from loorl.research.ablation import write_report  # noqa: E402


def ablation_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "ablation").glob("*.yaml"))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("name", nargs="?", help=f"a conf/ablation/ file: {', '.join(ablation_names())}")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per setting (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: rl.steps)")
    parser.add_argument(
        "--from", dest="sweeps", nargs="+", type=Path, help="finished multirun folders to read"
    )
    parser.add_argument("--out", type=Path, help="output folder (default outputs/ablations/NAME)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option {unknown[0]}; Hydra overrides are key=value")
    if args.sweeps is None and args.name is None:
        parser.error(f"name an ablation ({', '.join(ablation_names())}) or pass --from DIR")
    if args.sweeps is None and args.name not in ablation_names():
        parser.error(
            f"unknown ablation {args.name!r}: choose one of {', '.join(ablation_names())} (conf/ablation/)"
        )
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    for sweep in args.sweeps or []:
        if not sweep.is_dir():
            parser.error(f"--from {sweep}: no such folder")
    if args.sweeps and overrides:
        parser.error("--from reads finished runs: Hydra overrides have nothing to change")
    return args, overrides


def sweep_command(
    name: str, *, seeds: int, steps: int | None, sweep_dir: Path, overrides: list[str]
) -> list[str]:
    command = [sys.executable, str(ROOT / "src" / "train.py"), "-m", f"ablation={name}"]
    command.append("seed=" + ",".join(str(s) for s in range(seeds)))
    if steps is not None:
        command.append(f"rl.steps={steps}")
    return command + [f"hydra.sweep.dir={sweep_dir}", *overrides]


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    first = args.sweeps[0] if args.sweeps else None
    name = args.name or (first.resolve().parent.name if first.name == "runs" else first.name)
    out = (args.out or ROOT / "outputs" / "ablations" / name).resolve()
    started = time.perf_counter()
    if args.sweeps is None:
        sweep_dir = out / "runs"
        if sweep_dir.exists():
            print(f"error: {sweep_dir} exists (an earlier ablation): pass --out DIR for a new one, or "
                  f"--from {sweep_dir} to tabulate it again")  # fmt: skip
            return 2
        command = sweep_command(
            name, seeds=args.seeds, steps=args.steps, sweep_dir=sweep_dir, overrides=overrides
        )
        print("running:", shlex.join(command), flush=True)
        if subprocess.run(command, cwd=ROOT).returncode != 0:
            print(f"error: the sweep failed; the finished runs are under {sweep_dir} (--from {sweep_dir})")
            return 1
        sweeps, how = [sweep_dir], "`" + shlex.join(["python", "scripts/research/ablate.py", *argv]) + "`"
    else:
        sweeps, how = args.sweeps, "from " + ", ".join(f"`{s}`" for s in args.sweeps)
    seconds = time.perf_counter() - started
    note = f"Runs: {how}" + (f"; {seconds / 60:.1f} min." if args.sweeps is None else ".")
    write_report(sweeps, out, title=f"Ablation: {name}", note=note)
    print((out / "table.md").read_text())
    print(f"written to {out}/ (table.md, table.json, curves.png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
