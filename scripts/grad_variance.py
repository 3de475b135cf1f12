"""Gradient-variance probe: each estimator's policy-gradient noise on a fixed policy and prompt set.

    python scripts/grad_variance.py [--policy PATH] [--prompts 32] [--samples 8] [--repeats 30]
                                    [--shift 1.0] [--out DIR] [hydra overrides ...]

For `--repeats` R independent rollouts (K = `--samples` completions of each of the same `--prompts`
prompts, the HF engine at the run's temperature), every estimator turns the same rewards into
advantages and the trainer's own loss (`PolicyGradientModule.accumulate_gradients`, the configured
`loss.agg`) into a gradient. Reported: the relative variance tr(Cov)/||mean||^2 of the R gradients
with a 95% bootstrap interval over the repeats, and the same with every reward shifted by `--shift`
(leave-one-out and group-mean baselines are invariant to it; REINFORCE without a baseline is not).
Besides the registered estimators, `batch_mean` is REINFORCE with the batch's mean reward as
baseline. The policy: the configured model (default: the tiny model at the start of RL), an exported
HF folder or a loorl checkpoint. Writes `<out>/table.md` and `<out>/results.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from tqdm import tqdm  # noqa: E402

from loorl.algo import estimators  # noqa: E402
from loorl.algo.masked import masked_mean  # noqa: E402
from loorl.config import check_config, compose_config  # noqa: E402
from loorl.research.grad_variance import bootstrap_interval, gram_matrix, relative_variance_from_gram  # noqa: E402
from loorl.rollout.datamodule import sampler_seed  # noqa: E402


def batch_mean_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE with one baseline for the whole batch: its mean scorable reward. [B, K] -> [B, K]"""
    valid = rewards.isfinite()  # [B, K]
    r = torch.where(valid, rewards.float(), 0.0)  # [B, K]
    return torch.where(valid, r - masked_mean(r, valid), 0.0)  # [B, K]


def advantage_fns() -> dict:
    fns = {name: (lambda r, name=name: estimators.compute_advantages(name, r)) for name in estimators.names()}
    return {**fns, "batch_mean": batch_mean_baseline}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", help="an exported HF policy folder or a loorl .ckpt (default: the model)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts (fixed across repeats)")
    parser.add_argument("--samples", type=int, default=8, help="K completions per prompt")
    parser.add_argument("--repeats", type=int, default=30, help="R independent rollouts")
    parser.add_argument("--shift", type=float, default=1.0, help="the constant added to every reward")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "grad_variance")
    args, overrides = parser.parse_known_args(argv)
    if [o for o in overrides if o.startswith("-")]:
        parser.error(f"unknown option {[o for o in overrides if o.startswith('-')][0]}")
    if args.samples < 2:
        parser.error("--samples must be at least 2 (leave-one-out needs a sibling)")
    if args.repeats < 3 or args.prompts < 1:
        parser.error("--repeats must be at least 3 and --prompts at least 1")
    return args, overrides


def build(args, overrides):
    """The DataModule (engine, task, rewards) and the module (policy, loss) of the composed config."""
    from loorl.build import build_run
    from loorl.cli.evaluate import check_checkpoint, policy_kind

    sizes = [f"rl.samples_per_prompt={args.samples}"]
    sizes += [f"rl.prompts_per_{what}={args.prompts}" for what in ("step", "minibatch", "microbatch")]
    cfg = compose_config(f"output_dir={args.out}", "rollout=hf", *sizes, *overrides)
    kind = policy_kind(args.policy) if args.policy else None
    if kind == "hf":
        with open_dict(cfg):
            cfg.model.name_or_path = str(Path(args.policy).resolve())
    s = check_config(cfg)
    if kind == "checkpoint":
        check_checkpoint(Path(args.policy), cfg)
    parts = build_run(s)
    datamodule, module = parts.datamodule, parts.module
    datamodule.task.prepare(parts.tokenizer, max_prompt_length=s.rollout.max_prompt_length)
    module.configure_model()
    if kind == "checkpoint":
        state = torch.load(args.policy, map_location="cpu", weights_only=False)["state_dict"]
        module.load_state_dict(state, strict=False)
    datamodule.engine.sync(module.policy, version=0, force=True)
    return cfg, s, datamodule, module


def flat_gradient(module, batch) -> torch.Tensor:
    """The trainer's gradient of one rollout batch, flattened [D] (float32)."""
    module.policy.zero_grad(set_to_none=True)
    module.accumulate_gradients(batch, lambda loss: loss.backward())
    grads = [p.grad.reshape(-1) for p in module.policy.parameters() if p.grad is not None]
    return torch.cat(grads).float()  # [D]


def main(argv) -> int:
    args, overrides = parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    cfg, s, datamodule, module = build(args, overrides)
    prompts = datamodule.task.prompts_for_step(0, args.prompts, seed=s.run.seed)
    fns = advantage_fns()
    shifts = (0.0, args.shift)
    grads = {(name, shift): [] for name in fns for shift in shifts}
    accuracy = []
    for r in tqdm(range(args.repeats), desc="repeats", unit="rollout"):
        rollout = datamodule.rollout(prompts, seed=sampler_seed(s.run.seed, "grad_variance", r), step=r)
        rewards = rollout.batch.rewards.view(args.prompts, args.samples)  # [B, K]
        accuracy.append(rollout.stats["rollout/accuracy"])
        for (name, shift), store in grads.items():
            advantages = fns[name](rewards + shift).reshape(-1)  # [B*K]
            store.append(flat_gradient(module, replace(rollout.batch, advantages=advantages)))
    rows = []
    for (name, shift), store in grads.items():
        gram = gram_matrix(torch.stack(store))  # [R, R]
        low, high = bootstrap_interval(gram, samples=args.bootstrap)
        value = relative_variance_from_gram(gram)
        mean_norm = float(np.sqrt(gram.sum()) / len(gram))  # ||mean gradient||
        rows.append({"estimator": name, "shift": shift, "relative_variance": value, "ci95": [low, high],
                     "mean_grad_norm": mean_norm})  # fmt: skip
    seconds = time.perf_counter() - started
    results = {
        "command": "python scripts/grad_variance.py " + " ".join(argv),
        "model": cfg.model.name if not args.policy else args.policy,
        "task": cfg.task.name,
        "loss_agg": s.loss.agg,
        "prompts": args.prompts,
        "samples": args.samples,
        "repeats": args.repeats,
        "rollout_accuracy": float(np.mean(accuracy)),
        "seconds": seconds,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results, shifts)
    (args.out / "table.md").write_text(text)
    print("\n" + text + f"\nwritten to {args.out}/ (table.md, results.json)")
    return 0


def table(results: dict, shifts: tuple[float, float]) -> str:
    by = {(r["estimator"], r["shift"]): r for r in results["rows"]}
    names = sorted({r["estimator"] for r in results["rows"]})

    def cell(row):
        low, high = row["ci95"]
        return f"{row['relative_variance']:.3f} [{low:.3f}, {high:.3f}]"

    head = f"| estimator | rewards as given | rewards + {shifts[1]:g} |"
    lines = [
        f"## Relative gradient variance on {results['task']} ({results['model']})",
        "",
        head,
        "| --- | --- | --- |",
    ]
    lines += [f"| {n} | {cell(by[(n, shifts[0])])} | {cell(by[(n, shifts[1])])} |" for n in names]
    lines += [
        "",
        f"tr(Cov[g]) / ||E[g]||^2 over {results['repeats']} rollouts of {results['prompts']} fixed prompts x "
        f"{results['samples']} samples (loss.agg={results['loss_agg']}; rollout accuracy "
        f"{100 * results['rollout_accuracy']:.1f}%), [95% bootstrap interval over the rollouts]; "
        f"{results['seconds']:.0f} s. `batch_mean`: REINFORCE with the batch's mean reward as baseline.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
