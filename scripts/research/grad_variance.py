"""Gradient-variance probe: each estimator's policy-gradient noise on a fixed policy and prompt set.

    python scripts/research/grad_variance.py [--policy PATH] [--prompts 32] [--samples 8] [--repeats 30]
                                    [--shift 1.0] [--out DIR] [hydra overrides ...]

The command line of `loorl.research.probe` (what it measures is there): for `--repeats` R rollouts of
the same `--prompts` prompts x `--samples` K, every registered estimator, the run's own plug-in
(`estimator._target_=...`) and `batch_mean` turn the same rewards into the trainer's gradient; the
relative variance tr(Cov)/||mean||^2 of the R gradients with a 95% bootstrap interval, as given and with
every reward shifted by `--shift`. The policy: the configured model (default: the tiny model at the
start of RL), an exported HF folder or a loorl checkpoint. Writes `<out>/table.md` and
`<out>/results.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from loorl.research.probe import ProbeOptions, add_options, options_from, probe, table  # noqa: E402
from loorl.util.onednn import cap_onednn_primitive_cache  # noqa: E402


def parse_args(argv) -> tuple[ProbeOptions, Path, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_options(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "grad_variance")
    args, overrides = parser.parse_known_args(argv)
    if [o for o in overrides if o.startswith("-")]:
        parser.error(f"unknown option {[o for o in overrides if o.startswith('-')][0]}")
    options = options_from(args)
    try:
        options.check()
    except ValueError as error:
        parser.error(str(error))
    return options, args.out, overrides


def main(argv) -> int:
    options, out, overrides = parse_args(argv)
    cap_onednn_primitive_cache()  # before this process's first bf16 product (loorl.util.onednn)
    results = probe(
        options, overrides, out, command="python scripts/research/grad_variance.py " + " ".join(argv)
    )
    print("\n" + table(results) + f"\nwritten to {out}/ (table.md, results.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
