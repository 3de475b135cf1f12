"""Where an RL step's time goes, per phase, with the FLOP utilisation of each against the CPU's peak.

    python scripts/profile_step.py                                  # the default tiny run
    python scripts/profile_step.py model=smollm2_135m task=chat_arithmetic rollout.max_new_tokens=24 \
        optimizer.lr=1e-5 --steps 3 --warmup 2                      # add model.dtype=bfloat16 for bf16

Runs a short training run with the given overrides: `--warmup` steps, then `--steps` steps under the
torch profiler (operator FLOPs on), then `--steps` more without it. Every profiled operator goes to
the loorl phase whose `loorl/<phase>` range encloses it (`loorl.util.profiling`: gen, grade, prepare,
forward, backward, entropy, optimizer; the rest is Lightning, logging and Python). Wall seconds per
phase are the run's own `perf/<phase>_seconds` of the last, unprofiled steps (the profiler slows
what it watches); GFLOP/s divides the counted FLOPs per step (matrix products and attention) by
those seconds; utilisation compares it with a 2048^3 matrix product measured here in the compute
dtype. Writes outputs/bench/profile.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from loorl.config import CONF_DIR  # noqa: E402
from loorl.util.hardware import matmul_seconds  # noqa: E402
from loorl.util.profiling import PHASES  # noqa: E402


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n matrix product in `dtype` (best of `repeats`, after a warm-up)."""
    return 2 * n**3 / matmul_seconds(dtype, size=n, reps=repeats) / 1e9


class ProfileSteps(L.Callback):
    """The torch profiler around RL steps [first, first + count)."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count, self.profiler = first, count, None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.first:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   with_flops=True)  # fmt: skip
            self.profiler.__enter__()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.profiler is not None and trainer.current_epoch == self.first + self.count - 1:
            self.profiler.__exit__(None, None, None)


def phase_flops(profiler) -> dict[str, float]:
    """Counted FLOPs per phase: each operator goes to its innermost enclosing `loorl/<phase>` range."""
    flops = dict.fromkeys(PHASES, 0.0)
    for event in profiler.events():
        if not event.flops:
            continue
        parent, phase = event.cpu_parent, "other"
        while parent is not None:
            if parent.name.startswith("loorl/"):
                phase = parent.name.removeprefix("loorl/")
                break
            parent = parent.cpu_parent
        flops[phase] = flops.get(phase, 0.0) + event.flops
    return flops


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warmup", type=int, default=2, help="RL steps before the profiled ones")
    parser.add_argument("--steps", type=int, default=3, help="RL steps profiled")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "profile.md")
    parser.add_argument("overrides", nargs="*", help="loorl config overrides (as for src/train.py)")
    args = parser.parse_args()

    from loorl.cli import train as train_module

    steps = args.warmup + 2 * args.steps
    run_dir = args.out.parent / "profile_run"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, f"rl.steps={steps}", f"val_every={steps + 1}",
                                          "val_pass_k=0", "checkpoint_every=0", "export_policy=false",
                                          "trainer.enable_progress_bar=false", "logger=csv",
                                          f"output_dir={run_dir}"])  # fmt: skip
    profile = ProfileSteps(args.warmup, args.steps)
    original = L.Trainer.__init__

    def with_profile(self, *a, callbacks=None, **kw):  # train() builds its Trainer: add the callback
        original(self, *a, callbacks=[*(callbacks or []), profile], **kw)

    L.Trainer.__init__ = with_profile
    try:
        train_module.train(cfg)
    finally:
        L.Trainer.__init__ = original

    import csv

    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("perf/step_seconds")]
    timed = rows[args.warmup + args.steps :]  # after the profiled steps, unprofiled
    seconds = {p: statistics.fmean(float(r.get(f"perf/{p}_seconds") or 0.0) for r in timed) for p in PHASES}
    step = statistics.fmean(float(r["perf/step_seconds"]) for r in timed)
    flops = {p: f / args.steps for p, f in phase_flops(profile.profiler).items()}
    compute = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    peak = matmul_peak(compute)
    lines = [
        f"## Step profile: `{' '.join(args.overrides) or 'the default run'}`",
        "",
        f"Mean over {args.steps} unprofiled RL steps: {step:.2f} s per step (FLOPs: {args.steps} profiled "
        f"steps before them, after {args.warmup} warm-up steps). Peak: a 2048^3 "
        f"{str(compute).removeprefix('torch.')} matrix product at {peak:.0f} GFLOP/s on "
        f"{torch.get_num_threads()} threads.",
        "",
        "| phase | seconds | share | GFLOP | GFLOP/s | of peak |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in PHASES:
        s, gf = seconds.get(p, 0.0), flops.get(p, 0.0) / 1e9
        rate = gf / s if s > 0 else 0.0
        lines.append(
            f"| {p} | {s:.3f} | {100 * s / step:.0f}% | {gf:.1f} | {rate:.0f} | {100 * rate / peak:.0f}% |"
        )
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print("\n" + text + f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
