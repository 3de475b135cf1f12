"""Run a study (`conf/study/NAME.yaml`) and write its tables and plots (docs/research/which-estimator.md).

    python scripts/research/study.py which_estimator                   # run what is missing, then the report
    python scripts/research/study.py which_estimator --only k --seeds 2 # one part, its first 2 seeds
    python scripts/research/study.py exploration --settings recipe clip_cov   # these settings' runs only
    python scripts/research/study.py which_estimator --plan            # the settings' config differences only
    python scripts/research/study.py which_estimator --report          # the report from the runs there are
    python scripts/research/study.py which_estimator model=qwen7b --out outputs/studies/qwen7b \
        --report-dir DIR
                                                              # every run with these overrides too

Before anything runs, every setting's config is composed and its differences from the part's first
setting printed; a difference the part does not name stops the study. Runs go to
`<out>/runs/<config hash>/seed<i>/` (out: outputs/studies/NAME); a finished one is never run again, so
an interrupted study continues where it stopped, and a run cut short resumes from its last checkpoint
where it kept one. The report goes to the study's `report_dir`: per part `<part>.md` (tables),
`<part>.json` (every number) and `<part>_*.png`. Each finished run is also recorded there
(`runs/<config hash>/seed<i>.json.gz`: its config and metrics, 30-75 KB), and a recorded run
counts as finished: commit the records with the report, and a fresh clone writes the same report, or
adds seeds and settings to it, without the run folders.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from loorl.config import ConfigError  # noqa: E402
from loorl.research.study import load_study, study_names  # noqa: E402
from loorl.research.study_configs import check_part  # noqa: E402
from loorl.research.study_records import recorded_configs, resolved_elsewhere  # noqa: E402
from loorl.research.study_report import write_study_report  # noqa: E402
from loorl.research.study_runs import run_probe, run_training  # noqa: E402
from loorl.util.hardware import machine_line  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("name", help=f"a conf/study/ file: {', '.join(study_names())}")
    parser.add_argument("--only", nargs="+", help="these parts only (default: all, in the file's order)")
    parser.add_argument("--seeds", type=int, help="at most the first N seeds of each part")
    parser.add_argument(
        "--settings",
        nargs="+",
        help="run these settings only (default: all); the report takes every finished run",
    )
    parser.add_argument("--out", type=Path, help="where the runs go (default outputs/studies/NAME)")
    parser.add_argument(
        "--report-dir", type=Path, help="where the report goes (default: the study's report_dir)"
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--plan", action="store_true", help="check and print the settings' differences only")
    what.add_argument("--report", action="store_true", help="write the report from the finished runs only")
    args, overrides = parser.parse_known_args(argv)
    for key in ("only", "settings"):  # `--only smollm2 model=qwen7b`: nargs="+" took the override too
        if getattr(args, key):
            overrides += [o for o in getattr(args, key) if "=" in o]
            setattr(args, key, [o for o in getattr(args, key) if "=" not in o])
    unknown = [o for o in overrides if o.startswith("-") or "=" not in o]
    if unknown:
        parser.error(f"unknown argument {unknown[0]}; Hydra overrides for every run are key=value")
    args.overrides = overrides
    if args.seeds is not None and args.seeds < 1:
        parser.error("--seeds must be at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        study = load_study(args.name, seeds=args.seeds, only=args.only, extra=args.overrides)
        for part in study.parts:
            check_part(part)
        known = {s.label for part in study.parts for s in part.settings}
        for label in args.settings or []:
            if label not in known:
                raise ConfigError(
                    f"--settings {label}: no such setting; the settings: {', '.join(sorted(known))}"
                )
    except ConfigError as error:
        print(f"error: {error}")
        return 2
    report_dir = (args.report_dir or ROOT / study.report_dir).resolve()  # also the finished runs' records
    recorded = recorded_configs(report_dir)
    for part in study.parts:  # e.g. bf16 records read on a CPU without bf16 units: said before any run
        for line in resolved_elsewhere(recorded, part):
            print(line)
    if args.plan:
        return 0
    out = (args.out or ROOT / "outputs" / "studies" / args.name).resolve()
    started, failed = time.perf_counter(), []
    if not args.report:
        for part in study.parts:
            if part.kind == "probe":
                failed += run_probe(out, part, records=report_dir)
            else:
                failed += run_training(out, part, labels=args.settings, records=report_dir)
    per_step = {
        part.name: {s.label: s.report_facts for s in part.settings}
        for part in study.parts
        if part.kind == "train"
    }
    command = shlex.join(["python", "scripts/research/study.py", *argv])
    write_study_report(study, out, report_dir, per_step, command=command, machine=machine_line())
    minutes = (time.perf_counter() - started) / 60
    print(f"report written to {report_dir}/ ({minutes:.1f} min)")
    if failed:
        print(f"{len(failed)} run(s) failed (run the same command again to retry them):")
        print("\n".join(f"  {f}" for f in failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
