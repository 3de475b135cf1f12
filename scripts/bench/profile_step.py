"""Where an RL step's time goes, per phase, with the FLOP utilisation of each against the CPU's peak.

    python scripts/bench/profile_step.py                                  # the default tiny run
    python scripts/bench/profile_step.py model=smollm2_135m task=chat_arithmetic rollout.max_new_tokens=24 \
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from loorl.config import CONF_DIR  # noqa: E402
from loorl.util.hardware import matmul_flops_per_s, uses_cuda  # noqa: E402
from loorl.util.onednn import cap_onednn_primitive_cache  # noqa: E402
from loorl.util.profiling import PHASES  # noqa: E402


class ProfileSteps(L.Callback):
    """The torch profiler around RL steps [first, first + count)."""

    def __init__(self, first: int, count: int, *, cuda: bool = False) -> None:
        self.first, self.count, self.profiler, self.cuda = first, count, None, cuda

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, with_flops=True)
            self.profiler.__enter__()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.profiler is not None and trainer.current_epoch == self.first + self.count - 1:
            self.profiler.__exit__(None, None, None)


def phase_of(event) -> str:
    """The loorl phase of the innermost `loorl/<phase>` range enclosing a profiled operator."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("loorl/"):
            return parent.name.removeprefix("loorl/")
        parent = parent.cpu_parent
    return "other"


def phase_totals(profiler, value) -> dict[str, float]:
    """`value(event)` summed per phase over the profiled operators (where it is non-zero)."""
    totals = dict.fromkeys(PHASES, 0.0)
    for event in profiler.events():
        amount = value(event)
        if amount:
            phase = phase_of(event)
            totals[phase] = totals.get(phase, 0.0) + amount
    return totals


def device_seconds(event) -> float:
    """Seconds of the kernels an operator launched itself (torch reports microseconds). A
    `record_function` range (loorl's phases, a compiled graph's region) also has a device-side span,
    which is not a kernel: it counts 0 (the first CUDA run summed them into `other`)."""
    if getattr(event, "is_user_annotation", False):
        return 0.0
    return getattr(event, "self_device_time_total", 0.0) / 1e6


def top_kernels(profiler, count: int = 15) -> list[str]:
    """Markdown rows of the operators with the most device time (self), over the profiled steps."""
    averages = [a for a in profiler.key_averages() if not getattr(a, "is_user_annotation", False)]
    ranked = sorted(averages, key=lambda a: getattr(a, "self_device_time_total", 0.0), reverse=True)
    rows = []
    for a in ranked[:count]:
        rows.append(f"| `{a.key[:70]}` | {a.count} | {getattr(a, 'self_device_time_total', 0.0) / 1e3:.1f} |")
    return rows


def gpu_matmul_peak(dtype: torch.dtype, n: int = 4096, repeats: int = 10) -> float:
    """GFLOP/s of an n x n x n matrix product in `dtype` on the current GPU (CUDA events)."""
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warmup", type=int, default=2, help="RL steps before the profiled ones")
    parser.add_argument("--steps", type=int, default=3, help="RL steps profiled")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "profile.md")
    parser.add_argument("overrides", nargs="*", help="loorl config overrides (as for src/train.py)")
    args = parser.parse_args()
    cap_onednn_primitive_cache()  # before this process's first bf16 product (loorl.util.onednn)

    from loorl.cli import train as train_module

    steps = args.warmup + 2 * args.steps
    run_dir = args.out.parent / "profile_run"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, f"rl.steps={steps}", f"val_every={steps + 1}",
                                          "val_pass_k=0", "checkpoint_every=0", "export_policy=false",
                                          "trainer.enable_progress_bar=false", "logger=csv",
                                          f"output_dir={run_dir}"])  # fmt: skip
    cuda = uses_cuda(str(cfg.trainer.accelerator))  # the run's own device rule (auto included)
    profile = ProfileSteps(args.warmup, args.steps, cuda=cuda)
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
    flops = {p: f / args.steps for p, f in phase_totals(profile.profiler, lambda e: e.flops).items()}
    busy = {p: s / args.steps for p, s in phase_totals(profile.profiler, device_seconds).items()}
    compute = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    peak = gpu_matmul_peak(compute) if cuda else matmul_flops_per_s(compute) / 1e9  # GFLOP/s
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    lines = [
        f"## Step profile: `{' '.join(args.overrides) or 'the default run'}`",
        "",
        f"Mean over {args.steps} unprofiled RL steps: {step:.2f} s per step (FLOPs: {args.steps} profiled "
        f"steps before them, after {args.warmup} warm-up steps). Peak: a 2048^3 "
        f"{str(compute).removeprefix('torch.')} matrix product at {peak:.0f} GFLOP/s on {where}.",
        "",
        "| phase | seconds | share | GFLOP | GFLOP/s | of peak |" + (" GPU busy s |" if cuda else ""),
        "| --- | --- | --- | --- | --- | --- |" + (" --- |" if cuda else ""),
    ]
    for p in PHASES:
        s, gf = seconds.get(p, 0.0), flops.get(p, 0.0) / 1e9
        rate = gf / s if s > 0 else 0.0
        row = f"| {p} | {s:.3f} | {100 * s / step:.0f}% | {gf:.1f} | {rate:.0f} | {100 * rate / peak:.0f}% |"
        lines.append(row + (f" {busy.get(p, 0.0):.3f} |" if cuda else ""))
    if cuda:
        lines += ["", f"Top operators by device time over the {args.steps} profiled steps:", ""]
        lines += ["| operator | calls | device ms |", "| --- | --- | --- |", *top_kernels(profile.profiler)]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print("\n" + text + f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
