"""The gradient-variance probe: each estimator's policy-gradient noise on one fixed policy and prompt set.

For `repeats` R independent rollouts (K = `samples` completions of each of the same `prompts` prompts,
the HF engine at the run's temperature), every estimator turns the same rewards into advantages and
the trainer's own loss (`PolicyGradientModule.accumulate_gradients`, the configured `loss.agg`) into
a gradient. Reported: the relative variance tr(Cov)/||mean||^2 of the R gradients with a 95% bootstrap
interval over the repeats (`loorl.research.grad_variance`), and the same with every reward shifted by
`shift` (leave-one-out and group-mean baselines are invariant to it; REINFORCE without a baseline is
not). The estimators: every registered one, the run's own when it is a plug-in (`estimator._target_`,
under its function's name), and `batch_mean`, REINFORCE with the batch's mean reward as baseline.

`scripts/research/grad_variance.py` is its command line; a study's probe part (`loorl.research.study`) calls
`probe` at a run's checkpoints and its report reads `read_results`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
from omegaconf import open_dict

from loorl.algo import estimators
from loorl.algo.estimators import AdvantageInput
from loorl.algo.masked import masked_mean
from loorl.research.grad_variance import bootstrap_interval, gram_matrix, relative_variance_from_gram

RESULTS = "results.json"  # what `probe` writes into its folder, beside table.md


@dataclass(frozen=True)
class ProbeOptions:
    policy: str | None = None  # an exported HF policy folder or a loorl .ckpt (None: the configured model)
    prompts: int = 32  # prompts, fixed across repeats
    samples: int = 8  # K completions per prompt
    repeats: int = 30  # R independent rollouts
    shift: float = 1.0  # the constant added to every reward
    bootstrap: int = 2000  # bootstrap resamples

    def check(self) -> None:
        """One line per bad value (`ValueError`), before anything is built."""
        if self.samples < 2:
            raise ValueError("--samples must be at least 2 (leave-one-out needs a sibling)")
        if self.repeats < 3 or self.prompts < 1:
            raise ValueError("--repeats must be at least 3 and --prompts at least 1")

    def arguments(self) -> list[str]:
        """The options as `scripts/research/grad_variance.py` takes them (the defaults left out)."""
        out = [] if self.policy is None else ["--policy", str(self.policy)]
        for name in ("prompts", "samples", "repeats", "shift", "bootstrap"):
            value = getattr(self, name)
            if value != getattr(ProbeOptions, name):
                out += [f"--{name}", f"{value:g}" if isinstance(value, float) else str(value)]
        return out


def add_options(parser: argparse.ArgumentParser) -> None:
    """The probe's options (`ProbeOptions`), on the script's parser and on the one that reads a
    study's `probe.args` (`parse_options`)."""
    defaults = ProbeOptions()
    parser.add_argument("--policy", help="an exported HF policy folder or a loorl .ckpt (default: the model)")
    parser.add_argument(
        "--prompts", type=int, default=defaults.prompts, help="prompts (fixed across repeats)"
    )
    parser.add_argument("--samples", type=int, default=defaults.samples, help="K completions per prompt")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="R independent rollouts")
    parser.add_argument(
        "--shift", type=float, default=defaults.shift, help="the constant added to every reward"
    )
    parser.add_argument("--bootstrap", type=int, default=defaults.bootstrap, help="bootstrap resamples")


def options_from(namespace: argparse.Namespace) -> ProbeOptions:
    """The options a parser with `add_options` read (not yet checked: `ProbeOptions.check`)."""
    return ProbeOptions(**{f.name: getattr(namespace, f.name) for f in fields(ProbeOptions)})


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # a ValueError for the caller's one-line error, not an exit
        raise ValueError(message)


def parse_options(args: list[str]) -> ProbeOptions:
    """Options given as the script takes them (`["--prompts", "32", ...]`); ValueError where one is not
    a probe option or not of its type (abbreviations are not taken)."""
    parser = _RaisingParser(add_help=False, allow_abbrev=False)
    add_options(parser)
    namespace, rest = parser.parse_known_args(args)
    if rest:
        raise ValueError(f"not probe options: {rest}")
    return options_from(namespace)


def batch_mean_baseline(inp: AdvantageInput) -> torch.Tensor:
    """REINFORCE with one baseline for the whole batch: its mean scorable reward. [B, K] -> [B, K]"""
    valid = inp.rewards.isfinite()  # [B, K]
    r = torch.where(valid, inp.rewards.float(), 0.0)  # [B, K]
    return torch.where(valid, r - masked_mean(r, valid), 0.0)  # [B, K]


def advantage_fns(estimator=None) -> dict[str, Callable[[AdvantageInput], torch.Tensor]]:
    """name -> what the trainer hands an estimator (`AdvantageInput`) -> advantages [B, K]: every
    registered estimator whose inputs the probed run's rollouts hold (`estimators.needs`: ReMax's greedy
    baselines and GDPO's reward parts only when the run's own estimator draws them), the run's own
    plug-in (`estimator`: its `EstimatorSettings`, when `_target_` names a function; shown under the
    function's name, `<name> (_target_)` where that is a registered name) and `batch_mean`. Each with
    its defaults (no whitening), as the registered ones."""
    held = set(estimators.needs(estimator.function)) if estimator is not None else set()
    fns = {name: estimators.get(name) for name in estimators.names()
           if set(estimators.needs(estimators.get(name))) <= held}  # fmt: skip
    if estimator is not None and estimator.target is not None:
        label = estimator.label if estimator.label not in fns else f"{estimator.label} (_target_)"
        fns[label] = estimator.function
    return {**fns, "batch_mean": batch_mean_baseline}


def build_probed_run(options: ProbeOptions, overrides: list[str], out: Path):
    """The composed config, its settings, the DataModule (engine, task, rewards) and the module (policy,
    loss), the policy loaded from `options.policy` where given and synced into the engine."""
    from loorl.build import build_run
    from loorl.config import check_config, compose_config
    from loorl.training.saved_policy import check_checkpoint, policy_kind

    sizes = [f"rl.samples_per_prompt={options.samples}"]
    sizes += [f"rl.prompts_per_{what}={options.prompts}" for what in ("step", "minibatch", "microbatch")]
    cfg = compose_config(f"output_dir={out}", "rollout=hf", *overrides, *sizes)  # the probe's sizes win
    kind = policy_kind(options.policy) if options.policy else None
    if kind == "hf":
        with open_dict(cfg):
            cfg.model.name_or_path = str(Path(options.policy).resolve())
    s = check_config(cfg)
    if kind == "checkpoint":
        check_checkpoint(Path(options.policy), cfg)
    parts = build_run(s)
    datamodule, module = parts.datamodule, parts.module
    datamodule.task.prepare(parts.tokenizer, max_prompt_length=s.rollout.max_prompt_length)
    module.configure_model()
    if kind == "checkpoint":
        state = torch.load(options.policy, map_location="cpu", weights_only=False)["state_dict"]
        module.load_state_dict(state, strict=False)
    datamodule.engine.sync(module.policy, version=0, force=True)
    return cfg, s, datamodule, module


def flat_gradient(module, batch) -> torch.Tensor:
    """The trainer's gradient of one rollout batch, flattened [D] (float32)."""
    module.policy.zero_grad(set_to_none=True)
    module.accumulate_gradients(batch, lambda loss: loss.backward())
    grads = [p.grad.reshape(-1) for p in module.policy.parameters() if p.grad is not None]
    return torch.cat(grads).float()  # [D]


def probe(
    options: ProbeOptions, overrides: list[str], out: Path, *, command: str = "", progress=True
) -> dict:
    """Run the probe on the policy of `overrides` (Hydra overrides of `conf/train.yaml`) and write
    `<out>/results.json` and `<out>/table.md`; returns the results (`command`: how it was asked for)."""
    from tqdm import tqdm

    from loorl.rollout.datamodule import sampler_seed

    options.check()
    started = time.perf_counter()
    torch.manual_seed(0)
    cfg, s, datamodule, module = build_probed_run(options, overrides, out)
    prompts = datamodule.task.prompts_for_step(0, options.prompts, seed=s.run.seed)
    fns = advantage_fns(s.estimator)
    shifts = (0.0, options.shift)
    grads = {(name, shift): [] for name in fns for shift in shifts}
    accuracy = []
    for r in tqdm(range(options.repeats), desc="repeats", unit="rollout", disable=not progress):
        seed = sampler_seed(s.run.seed, "grad_variance", r)
        rollout = datamodule.sample_and_grade(prompts, seed=seed, step=r)
        batch = rollout.batch
        inp = AdvantageInput.of_batch(batch)  # [B, K] with the greedy baselines and parts it holds
        accuracy.append(rollout.stats["rollout/accuracy"])
        for (name, shift), store in grads.items():
            advantages = fns[name](replace(inp, rewards=inp.rewards + shift)).reshape(-1)  # [B*K]
            store.append(flat_gradient(module, replace(batch, advantages=advantages)))
    rows = []
    for (name, shift), store in grads.items():
        gram = gram_matrix(torch.stack(store))  # [R, R]
        low, high = bootstrap_interval(gram, samples=options.bootstrap)
        value = relative_variance_from_gram(gram)
        mean_norm = float(np.sqrt(gram.sum()) / len(gram))  # ||mean gradient||
        rows.append({"estimator": name, "shift": shift, "relative_variance": value, "ci95": [low, high],
                     "mean_grad_norm": mean_norm})  # fmt: skip
    results = {
        "command": command,
        "model": cfg.model.name if not options.policy else options.policy,
        "task": cfg.task.name,
        "loss_agg": s.loss.agg,
        "prompts": options.prompts,
        "samples": options.samples,
        "repeats": options.repeats,
        "rollout_accuracy": float(np.mean(accuracy)),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS).write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table(results))
    return results


def read_results(out: Path) -> dict | None:
    """What `probe` wrote into `out`; None when it has not (yet)."""
    path = out / RESULTS
    return json.loads(path.read_text()) if path.is_file() else None


def table(results: dict) -> str:
    """The results as a markdown table: each estimator's relative variance, as given and shifted."""
    by = {(r["estimator"], r["shift"]): r for r in results["rows"]}
    names = sorted({r["estimator"] for r in results["rows"]})
    shifts = sorted({r["shift"] for r in results["rows"]}, key=lambda x: x != 0)  # 0 first

    def cell(row):
        low, high = row["ci95"]
        return f"{row['relative_variance']:.3f} [{low:.3f}, {high:.3f}]"

    lines = [
        f"## Relative gradient variance on {results['task']} ({results['model']})",
        "",
        f"| estimator | rewards as given | rewards + {shifts[-1]:g} |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {n} | {cell(by[(n, shifts[0])])} | {cell(by[(n, shifts[-1])])} |" for n in names]
    lines += [
        "",
        f"tr(Cov[g]) / ||E[g]||^2 over {results['repeats']} rollouts of {results['prompts']} fixed prompts x "
        f"{results['samples']} samples (loss.agg={results['loss_agg']}; rollout accuracy "
        f"{100 * results['rollout_accuracy']:.1f}%), [95% bootstrap interval over the rollouts]; "
        f"{results['seconds']:.0f} s. `batch_mean`: REINFORCE with the batch's mean reward as baseline.",
    ]
    return "\n".join(lines) + "\n"
