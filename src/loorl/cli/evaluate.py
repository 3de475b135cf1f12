"""`evaluate(cfg) -> metrics`: a trained policy on a task's split, with the validation loop's own code.

`src/eval.py policy=PATH` composes `conf/eval.yaml` (the training config plus an `eval` section).
The policy is an exported HF folder (`<run>/policy`: loaded as the model) or a loorl checkpoint
(`<run>/checkpoints/last.ckpt`: its weights over the configured base model, whose identity the
checkpoint must share). Lightning's `validate` then runs `RolloutDataModule.heldout_results` over the
prompts (greedy pass@1 and reward; pass@k and maj@k from n samples), and the results are written
as `results.json`, `results.md` and `samples.csv` in the output folder. With `lm_eval.tasks`, lm-eval
runs on the same policy too and writes its results beside them (`loorl.cli.lm_harness`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from loorl.cli.lm_harness import (
    HarnessSettings,
    export_checkpoint,
    require_lm_eval,
    run_harness,
    task_manager,
)
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.models.sources import model_label
from loorl.settings import EvalSettings
from loorl.training.saved_policy import check_checkpoint, policy_kind

log = logging.getLogger(__name__)


def markdown(results: dict) -> str:
    m, e = results["metrics"], results["eval"]

    def pct(x):
        return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"

    more = results.get("extra_prompts", 0)
    extra = f"; {more} more at task.eval_levels, outside pass@1: their own rows" if more else ""
    rows = [
        ("policy", f"`{results['policy']}`"),
        ("task (split, prompts)", f"{results['task']} ({e['split']}, {results['num_prompts']}{extra})"),
        ("greedy pass@1", pct(m["pass@1_greedy"])),
        *((f"greedy pass@1, {name}", pct(value)) for name, value in results.get("per_source", {}).items()),
        ("mean reward (greedy)", "n/a" if math.isnan(m["reward"]) else f"{m['reward']:.3f}"),
        ("unscorable greedy samples (left out of pass@1)", f"{m.get('unscorable', 0):.0f}"),
    ]
    if e["samples"]:
        rows += [
            (f"pass@{e['k']} (unbiased, n={e['samples']})", pct(m[f"pass@{e['k']}"])),
            (f"maj@{e['k']} (majority vote)", pct(m[f"maj@{e['k']}"])),
        ]
    rows += list(results.get("facts", {}).items())  # e.g. the sandbox isolation of a code task
    rows.append(("wall time", f"{results['seconds']:.1f} s"))
    lines = [f"## Evaluation: {results['model']}", "", "| metric | value |", "| --- | --- |"]
    return "\n".join(lines + [f"| {k} | {v} |" for k, v in rows]) + "\n"


def evaluate(cfg: DictConfig) -> dict:
    """Check the settings, load the policy, run the validation loop once, write the results; with
    `lm_eval.tasks`, lm-eval's tasks on the same policy too (`loorl.cli.lm_harness`)."""
    started = time.perf_counter()
    if OmegaConf.is_missing(cfg, "policy"):
        raise ConfigError("policy is not set: pass policy=<run>/policy or policy=<run>/checkpoints/last.ckpt")
    harness = HarnessSettings.from_cfg(cfg.get("lm_eval"), "lm_eval")
    if harness.tasks:  # before anything loads: its absence is one line, not a traceback after a model load
        require_lm_eval()
    e = EvalSettings.from_cfg(cfg.eval, "eval")
    kind = policy_kind(cfg.policy)
    policy = Path(os.path.expanduser(cfg.policy)).resolve()
    with open_dict(cfg):
        if kind == "hf":
            cfg.model.name_or_path = str(policy)
        cfg.val_pass_k = e.k if e.samples else 0
    s = check_config(cfg)
    if kind == "checkpoint":
        check_checkpoint(policy, cfg, lora=s.model.lora)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    manager = task_manager(harness) if harness.tasks else None  # an unknown task name fails here
    results = own_evaluation(cfg, s, e, kind, policy, output_dir, started) if harness.loorl else {}
    if harness.tasks:
        results["lm_eval"] = lm_eval_part(harness, manager, s, kind, policy, output_dir)
    return results


def lm_eval_part(harness, manager, s, kind: str, policy: Path, output_dir: Path) -> dict:
    """lm-eval on the policy (a checkpoint: written out as a temporary HF folder first); its table
    goes into results.md after loorl's own (or alone), and is printed."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lm_eval_policy_", dir=output_dir) as tmp:
        model_dir = policy if kind == "hf" else export_checkpoint(s, policy, Path(tmp) / "policy")
        part = run_harness(harness, manager, model_dir, dtype=s.model.dtype, output_dir=output_dir)
    if not part:
        return part
    part["seconds"] = time.perf_counter() - started
    section = f"## lm-eval: {policy}\n\n{part['table']}"
    own = output_dir / "results.md"  # loorl's table, just written (lm_eval.loorl=true)
    own.write_text((own.read_text() + "\n" if harness.loorl and own.is_file() else "") + section)
    files = "lm_eval_results.json" + (", lm_eval_samples_<task>.jsonl" if harness.log_samples else "")
    print("\n" + section + f"\nwritten to {output_dir}/ (results.md, {files})")
    return part


def own_evaluation(cfg: DictConfig, s, e, kind: str, policy: Path, output_dir: Path, started: float) -> dict:
    """loorl's own evaluation: the validation loop once over the task's prompts."""
    from hydra.utils import instantiate

    from loorl.build import build_run, build_task
    from loorl.cli.trainer_parts import trainer_precision
    from loorl.rollout.engines.sync import EngineSync  # Lightning: imported once the settings are checked
    from loorl.training.callbacks import SampleLog

    task = build_task(s)
    for name, line in task.run_facts().items():
        log.info("%s: %s", name, line)
    evaluation = {"eval_samples": e.samples, "eval_split": e.split, "eval_limit": e.num_prompts}
    parts = build_run(s, task=task, **evaluation)
    datamodule, module = parts.datamodule, parts.module
    trainer = instantiate(
        cfg.trainer,
        logger=False,
        callbacks=[EngineSync(datamodule.engine), SampleLog(str(output_dir / "samples.csv"), rows=e.rows)],
        precision=trainer_precision(cfg),
    )
    # Lightning warns that the callbacks that wrote the checkpoint are absent: evaluation reads only weights
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
    logged = trainer.validate(
        module, datamodule=datamodule, ckpt_path=str(policy) if kind == "checkpoint" else None, verbose=False
    )[0]
    metrics = {
        "pass@1_greedy": logged["val/accuracy"],
        "reward": logged.get("val/reward", float("nan")),
        "unscorable": logged.get("val/unscorable", 0.0),
    }
    if e.samples:
        metrics[f"pass@{e.k}"] = logged["val/pass_at_k"]
        metrics[f"maj@{e.k}"] = logged["val/maj_at_k"]
    overall = [p.meta.get("in_overall", True) for p in datamodule.eval_prompts]
    results = {
        "policy": str(policy),
        "model": model_label(s.model) if kind == "checkpoint" else str(policy),
        "task": s.task["name"],
        "num_prompts": sum(overall),  # those pass@1 covers
        "extra_prompts": len(overall) - sum(overall),  # task.eval_levels' sets: only in per_source
        "per_source": {  # greedy accuracy per dataset of a mixed task (reasoning-gym: <name>@L<level> too)
            k.removeprefix("val/accuracy/"): float(v)
            for k, v in logged.items()
            if k.startswith("val/accuracy/")
        },
        "eval": {"split": e.split, "samples": e.samples, "k": e.k, "seed": s.run.seed},
        "metrics": {k: float(v) for k, v in metrics.items()},
        "seconds": time.perf_counter() - started,
        "facts": task.run_facts(),
    }
    if trainer.is_global_zero:
        (output_dir / "results.json").write_text(json.dumps(results, indent=1))
        text = markdown(results)
        (output_dir / "results.md").write_text(text)
        print("\n" + text + f"\nwritten to {output_dir}/ (results.json, results.md, samples.csv)")
    return results


def main(cfg: DictConfig) -> dict:
    """The CLI: a bad setting prints one `error:` line and exits 2."""
    from loorl.cli.console import run_cli

    return run_cli(evaluate, cfg)
