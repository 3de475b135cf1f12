"""OmegaConf resolvers the configs use, registered when `loorl.config` is imported.

- `${loorl.sweep_group:}`: the sweep folder of a Hydra multirun job (one wandb group per sweep),
  null outside a multirun.
- `${loorl.sweep_job:}`: the job's overrides as a name (`estimator=grpo,seed=1`), null outside one.
- `${loorl.div:a,b}`: a // b for a fixed budget split into groups (`conf/ablation/k.yaml`: prompts per
  step = samples per step / K); an error when b does not divide a.
- `${loorl.on_rank_zero:x}`: x in the process of global rank 0 (or a single process), null in the
  others (`hydra.output_subdir`: one `.hydra/` folder per run, however many processes torchrun or srun
  start in it).
- `${loorl.per_rank:name}`: name on global rank 0, `name_rank<r>` on the others (`hydra.job.name`, so
  that each process logs to its own file in a shared run folder).
- `${loorl.completion_tokens:${rollout.max_new_tokens},${tools.max_turns},${tools.max_tokens}}`: a
  sample's completion limit, one turn or with tools the budget over its turns
  (`loorl.settings.completion_budget`; `loss.max_len`'s default).
- `${loorl.fast_dtype:${trainer.accelerator}}`: 'bfloat16' where bf16 compute is fast on the device
  the run trains on (a timed probe on CPU, `loorl.util.hardware.fast_compute_dtype`), else 'float32'.
- `${loorl.by_device:${trainer.accelerator},a,b}`: a where the run trains on the CPU, b where it trains
  on CUDA (`loorl.util.hardware.uses_cuda`): a recipe's setting whose best value differs by device.
"""

from __future__ import annotations

import inspect
import os

from omegaconf import OmegaConf

from loorl.errors import ConfigError


def _multirun_job():
    """Hydra's runtime config inside a multirun job, else None (a single run, or no Hydra app)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return hydra_cfg if hydra_cfg.mode == RunMode.MULTIRUN else None


def sweep_group() -> str | None:
    job = _multirun_job()
    return None if job is None else str(job.sweep.dir)


def sweep_job() -> str | None:
    job = _multirun_job()
    return None if job is None else (job.job.override_dirname or None)


def exact_div(a, b) -> int:
    a, b = int(a), int(b)
    if b <= 0 or a % b:
        raise ConfigError(f"loorl.div: {b} does not divide {a}: choose sizes whose quotient is whole")
    return a // b


def fast_dtype(accelerator: str = "auto") -> str:
    from loorl.util.hardware import fast_compute_dtype

    return fast_compute_dtype(str(accelerator))


def by_device(accelerator, on_cpu, on_cuda):
    from loorl.util.hardware import uses_cuda

    return on_cuda if uses_cuda(str(accelerator)) else on_cpu


def completion_tokens(max_new_tokens, max_turns, max_tokens) -> int:
    from loorl.settings import completion_budget

    return completion_budget(
        int(max_new_tokens), int(max_turns), None if max_tokens is None else int(max_tokens)
    )


# Lightning reads a process's rank from these, in this order (lightning.fabric.utilities.rank_zero)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def launch_rank() -> int:
    """The rank torchrun, srun or Lightning gave this process: `rank_zero_only.rank`, which Lightning
    sets on import and its Trainer at set-up, else (Lightning not imported yet) the environment it reads
    it from. A run's config is resolved and checked before Lightning loads (7 of a bad command's 10 s):
    Lightning's `_get_rank` is private, so its four lines are repeated here."""
    from lightning_utilities.core.rank_zero import rank_zero_only  # the object Lightning sets (light)

    rank = getattr(rank_zero_only, "rank", None)
    if rank is None:
        rank = next((int(os.environ[k]) for k in RANK_VARIABLES if os.environ.get(k) is not None), 0)
    return rank


def on_rank_zero(value):
    return value if launch_rank() == 0 else None


def per_rank(name: str) -> str:
    rank = launch_rank()
    return str(name) if rank == 0 else f"{name}_rank{rank}"


def register_resolver(name: str, fn, *, replace: bool) -> None:
    """OmegaConf's resolver registration under the name this release has without a warning:
    `register_resolver` from omegaconf 2.4 (which deprecates `register_new_resolver`; before 2.4,
    `register_resolver` was the legacy string-only API, so the name alone does not tell)."""
    if "replace" in inspect.signature(OmegaConf.register_resolver).parameters:  # 2.4 and later
        OmegaConf.register_resolver(name, fn, replace=replace)
    else:
        OmegaConf.register_new_resolver(name, fn, replace=replace)


def register() -> None:
    for name, fn in (("loorl.sweep_group", sweep_group), ("loorl.sweep_job", sweep_job),
                     ("loorl.div", exact_div), ("loorl.fast_dtype", fast_dtype),
                     ("loorl.on_rank_zero", on_rank_zero), ("loorl.per_rank", per_rank),
                     ("loorl.completion_tokens", completion_tokens),
                     ("loorl.by_device", by_device)):  # fmt: skip
        register_resolver(name, fn, replace=True)
