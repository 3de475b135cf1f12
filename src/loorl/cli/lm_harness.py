"""`src/eval.py ... lm_eval.tasks=[...]`: lm-eval (EleutherAI's lm-evaluation-harness) on the policy.

`run_harness` runs `lm_eval.simple_evaluate` with lm-eval's `hf` model on a Hugging Face folder (an
exported policy, any local model folder, or a loorl checkpoint written out to one first by
`export_checkpoint`) over tasks found by `lm_eval.tasks.TaskManager`: lm-eval's own and those of the
task YAMLs under `lm_eval.include_path`. It writes `lm_eval_results.json` (lm-eval's results, as its
own CLI writes them) and `lm_eval_samples_<task>.jsonl` (each document's prompt, response and score)
into the evaluation's output folder, beside loorl's `results.json`, and returns lm-eval's markdown table.

lm-eval is an optional extra (`pip install -e ".[lm-eval]"`): nothing in loorl imports it unless
`lm_eval.tasks` is set, and `require_lm_eval` turns its absence into one ConfigError line before any
model loads. A relative `data_files` path in a task YAML (lm-eval and `datasets` read it against the
working directory) is resolved against the YAML's own folder (`local_data_files`), so that a task folder
with its jsonl runs from anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from pydantic.dataclasses import dataclass

from loorl.errors import ConfigError
from loorl.settings import SCHEMA, NonNegativeInt, PositiveInt, Section

log = logging.getLogger(__name__)
INSTALL = 'pip install -e ".[lm-eval]"'


@dataclass(frozen=True, config=SCHEMA)
class HarnessSettings(Section):
    """`lm_eval` (conf/eval.yaml): lm-eval's run on the evaluated policy."""

    tasks: list[str] = dataclasses.field(default_factory=list)  # task/group/tag names; empty: off
    include_path: str | None = None  # a folder of task YAMLs (searched before lm-eval's own tasks)
    loorl: bool = True  # also run loorl's own evaluation (the `eval` section) before lm-eval
    limit: PositiveInt | None = None  # at most this many documents per task
    num_fewshot: NonNegativeInt | None = None  # None: each task's own setting
    batch_size: PositiveInt = 32
    log_samples: bool = True  # lm_eval_samples_<task>.jsonl

    def __post_init__(self) -> None:
        if not self.tasks and self.include_path is not None:
            raise ConfigError(
                f"lm_eval.include_path={self.include_path} is set but lm_eval.tasks is empty: name the tasks "
                "to run, e.g. lm_eval.tasks=[loorl_arithmetic]"
            )
        if not self.tasks and not self.loorl:
            raise ConfigError(
                "lm_eval.loorl=false leaves nothing to evaluate without lm_eval.tasks: name lm-eval tasks, "
                "or set lm_eval.loorl=true"
            )
        if self.include_path is not None and not include_dir(self.include_path).is_dir():
            raise ConfigError(
                f"lm_eval.include_path={self.include_path} is not a folder: pass the folder holding the task "
                "YAMLs (e.g. examples/lm_eval)"
            )


def include_dir(path: str) -> Path:
    return Path(path).expanduser().resolve()


def require_lm_eval() -> None:
    """lm-eval importable, or one ConfigError line naming the install command."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(f"lm_eval.tasks needs lm-eval, which is not installed: {INSTALL}") from None


# ---- tasks -----------------------------------------------------------------------------------------
def _absolute(files: Any, base: Path) -> tuple[Any, bool]:
    """`data_files` (a path, a list of them, or a split -> path(s) mapping) with relative paths joined
    to `base`; and whether any was relative. URLs and `hf://` paths stay as they are."""
    if isinstance(files, dict):
        pairs = {k: _absolute(v, base) for k, v in files.items()}
        return {k: v for k, (v, _) in pairs.items()}, any(c for _, c in pairs.values())
    if isinstance(files, list):
        pairs = [_absolute(v, base) for v in files]
        return [v for v, _ in pairs], any(c for _, c in pairs)
    if isinstance(files, str) and "://" not in files and not Path(files).expanduser().is_absolute():
        return str(base / files), True
    return files, False


def local_data_files(manager) -> list[str]:
    """Rewrite the entries of `manager`'s index whose YAML (under an include path) names relative
    `dataset_kwargs.data_files` or `data_dir`: their config, loaded as lm-eval loads it, with those
    paths joined to the YAML's folder. Groups reach their tasks through the same index, so a group's
    tasks are resolved too. Returns the rewritten task names."""
    from lm_eval.tasks._yaml_loader import load_yaml

    roots = manager.include_path or []
    roots = [include_dir(str(p)) for p in (roots if isinstance(roots, (list, tuple)) else [roots])]
    index, rewritten = manager.task_index, []
    for name, entry in list(index.items()):
        path = getattr(entry, "yaml_path", None)
        if path is None or not any(Path(path).resolve().is_relative_to(r) for r in roots):
            continue
        if entry.kind.name != "TASK":  # (groups name tasks; Python tasks hold their own loading)
            continue
        base = Path(path).resolve().parent
        kwargs = load_yaml(path, resolve_func=False).get("dataset_kwargs") or {}
        if not any(_absolute(kwargs.get(key), base)[1] for key in ("data_files", "data_dir")):
            continue
        cfg = load_yaml(path, resolve_func=True)
        kwargs = dict(cfg["dataset_kwargs"])
        for key in ("data_files", "data_dir"):
            if key in kwargs:
                kwargs[key] = _absolute(kwargs[key], base)[0]
        cfg["dataset_kwargs"] = kwargs
        index[name] = dataclasses.replace(entry, yaml_path=None, cfg=cfg)
        rewritten.append(name)
    return rewritten


def task_manager(settings: HarnessSettings):
    """A TaskManager that knows every name in `lm_eval.tasks`. lm-eval's own 14,000-odd task YAMLs take
    about 8 s to index on a 2-core CPU: they are indexed only when a name is not among the include
    path's tasks. An unknown name is one ConfigError line."""
    from lm_eval.tasks import TaskManager

    include = str(include_dir(settings.include_path)) if settings.include_path else None
    manager = TaskManager(include_path=include, include_defaults=False) if include else None
    if manager is None or not set(settings.tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=include)
    unknown = [t for t in settings.tasks if t not in manager.all_tasks]
    if unknown:
        where = f"lm_eval.include_path={settings.include_path}" if include else "lm-eval's own tasks"
        raise ConfigError(
            f"lm_eval.tasks: no task, group or tag named {', '.join(map(repr, unknown))} in {where}"
            + ("" if include else "; a task YAML of your own needs lm_eval.include_path=<its folder>")
        )
    local_data_files(manager)
    return manager


# ---- the run ---------------------------------------------------------------------------------------
def export_checkpoint(s, checkpoint: Path, target: Path) -> Path:
    """A loorl checkpoint written out as a Hugging Face folder (the policy and its tokenizer) by the
    code of a run's own export to `<run>/policy` (`save_policy`; a LoRA policy: merged)."""
    import torch

    from loorl.build import build_module, build_task
    from loorl.models.load import load_tokenizer
    from loorl.models.sources import resolve_model_path
    from loorl.training.callbacks import save_policy

    model_path = resolve_model_path(s.model, s.task, build_task(s))
    module = build_module(s, model_path)
    module.configure_model()
    state = torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True)
    module.load_state_dict(state["state_dict"])
    adapter_dir = target.with_name(target.name + "_adapter")
    save_policy(module.policy, load_tokenizer(model_path), target, adapter_dir=adapter_dir)
    return target


def run_harness(settings: HarnessSettings, manager, model_dir: Path, *, dtype: str, output_dir: Path) -> dict:
    """lm-eval on `model_dir`; writes its results and samples to `output_dir`. Returns
    `{"results": {task: {metric: value}}, "table": markdown}`."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable, make_table

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(model_dir), "dtype": dtype, "device": device},
        tasks=list(settings.tasks),
        task_manager=manager,
        num_fewshot=settings.num_fewshot,
        limit=settings.limit,
        batch_size=settings.batch_size,
        log_samples=settings.log_samples,
    )
    if out is None:  # (a rank other than 0 under lm-eval's own multi-process runs)
        return {}
    samples = out.pop("samples", None) or {}
    output_dir.mkdir(parents=True, exist_ok=True)
    dump = lambda x: json.dumps(x, default=handle_non_serializable)  # noqa: E731
    (output_dir / "lm_eval_results.json").write_text(dump(out) + "\n")
    for task, rows in samples.items():
        (output_dir / f"lm_eval_samples_{task}.jsonl").write_text("".join(dump(r) + "\n" for r in rows))
    table = make_table(out) + (("\n" + make_table(out, "groups")) if out.get("groups") else "")
    results = {
        task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in out["results"].items()
    }
    return {"results": results, "table": table}
