"""What a checkpoint must share with the run that loads it, and the settings that make a resumed run
the one it replaces.

`run_identity` is kept in every checkpoint (under `IDENTITY_KEY`); `check_identity` compares it with
the resuming run's before any model loads (`loorl.training.resume.resolve_resume`): a difference in
the model, the optimizer or the file format is one `ConfigError` line; one in the settings that shape
the run but not what can be loaded (seed, batch sizes, estimator, learning rate) is logged, since
the run continues but is not the one it replaces.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from loorl.errors import ConfigError

log = logging.getLogger(__name__)

IDENTITY_KEY = "loorl"  # where a checkpoint keeps the identity of the run that wrote it


def run_identity(s, *, model: str, strategy: str) -> dict:
    """What a checkpoint must share with the run that loads it (`load`: the model, the optimizer, the
    file format), and the settings that make the resumed run the one it replaces (`run`). `s`: the
    run's `loorl.config.Settings`."""
    return {
        "load": {
            "model": model,
            "optimizer": str(s.optimizer.get("_target_")),
            "format": "sharded (strategy=fsdp)" if strategy == "fsdp" else "one file",
            "lora": lora_identity(s.model.lora),
        },
        "run": {
            "seed": s.run.seed,
            "estimator": s.estimator.label,
            "rl.prompts_per_step": s.rl.prompts_per_step,
            "rl.samples_per_prompt": s.rl.samples_per_prompt,
            "rl.prompts_per_minibatch": s.rl.prompts_per_minibatch,
            "rl.epochs_per_rollout": s.rl.epochs_per_rollout,
            "optimizer.lr": s.optimizer.get("lr"),
            "kl.coef": s.kl.coef,
            "loss.agg": s.loss.agg,
            "task": s.task.get("name"),
            **task_identity(s.task),
            "model.lora.alpha": None if s.model.lora is None else s.model.lora.lora_alpha,
            "tools": tools_identity(s.tools),
            "environment": environment_identity(s.environment),
        },
    }


def task_identity(task: dict) -> dict:
    """What else than its name sets the problems a run trains and validates on: the curriculum's rule
    and fixed levels, and `task.eval_levels`. Each entry is None where unset, as in checkpoints written
    before it existed, so that resuming those warns of nothing new."""
    cur = dict(task.get("curriculum") or {})
    fixed = cur.pop("fixed_levels", None)
    return {
        "task.curriculum": json.dumps(cur, sort_keys=True) if cur.get("enabled") else None,
        "task.curriculum.fixed_levels": json.dumps(dict(fixed), sort_keys=True) if fixed else None,
        "task.eval_levels": list(task["eval_levels"]) if task.get("eval_levels") else None,
    }


def environment_identity(environment) -> str | None:
    """The environment class (or the routes' classes) whose instances the run's samples called, and
    whether its prompts carry their tools; None without one (as in checkpoints written before). Where
    the instances live (`isolation`) is not part of it: both places give the same run."""
    if not environment.chosen:
        return None
    chosen = environment.target or ", ".join(f"{k}: {v}" for k, v in sorted(environment.routes.items()))
    return f"{chosen} (tools in prompt {str(environment.tools_in_prompt).lower()})"


def tools_identity(tools) -> str | None:
    """The tools a run's samples call, and their limits; None without tools (as in checkpoints written
    before tools existed)."""
    if not tools.max_turns:
        return None
    names = ", ".join(sorted(tools.available))
    return f"{names} (max_turns {tools.max_turns}, max_tokens {tools.max_tokens})"


def lora_identity(lora) -> str | None:
    """What a checkpoint's adapters must match (`model.lora`'s shape), None for full weights. Checkpoints
    written before LoRA existed have no entry, which reads as None."""
    if lora is None:
        return None
    return f"r={lora.r} target_modules={','.join(lora.target_modules)}"


def check_identity(path: Path, saved: dict | None, current: dict) -> None:
    if saved is None:
        log.warning("resume_from=%s: the checkpoint does not say which model wrote it; not checked", path)
        return
    for key, value in current["load"].items():
        if saved["load"].get(key) != value:
            raise ConfigError(
                f"resume_from={path} was written with {key} {saved['load'].get(key)!r}, this run has "
                f"{value!r}: resume with the settings of the run that wrote it, or start a new run"
            )
    changed = [
        f"{k} {saved['run'].get(k)!r} -> {v!r}" for k, v in current["run"].items() if saved["run"].get(k) != v
    ]
    if changed:
        log.warning(
            "resuming with settings that differ from the checkpointed run (%s): it continues, but is not "
            "the run it replaces",
            "; ".join(changed),
        )
