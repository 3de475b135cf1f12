"""The run itself, as a sequence of named steps: memory set-up, resume, the memory plan, the run's
facts, the callbacks and loggers (`loorl.cli.trainer_parts`), the Trainer, fit, export and SLURM's
requeue. `loorl.cli.train.train` imports it once the settings are checked: this module loads Lightning,
transformers and the engines (about 7 s of the CLI's start)."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from loorl.build import build_run, build_task, identity
from loorl.cli.plan import check_memory, verdict_line, write_plan
from loorl.cli.trainer_parts import (
    build_trainer,
    finish_loggers,
    progress_display,
    run_callbacks,
    run_loggers,
    run_summary,
)
from loorl.models.random_weights import export_folder_name, mark_export, random_weights_facts
from loorl.parallel.distributed import shutdown
from loorl.parallel.launch import configure_threads, lightning_launched_processes
from loorl.training.graceful_stop import GracefulStop, requeue_slurm_job, slurm_job_id
from loorl.training.resume import Resume, resolve_resume
from loorl.util.allocator import keep_freed_memory, keeps_freed_memory
from loorl.util.hardware import cuda_available, machine_line, set_float32_matmul_precision
from loorl.util.peak_memory import reset_peak_memory

log = logging.getLogger("loorl.cli.train")  # the run's log lines keep the name they always had


def trains_on_cuda(trainer: L.Trainer) -> bool:
    """Whether the trainer's accelerator is CUDA (the condition of `determinism_note`)."""
    from lightning.pytorch.accelerators import CUDAAccelerator

    return isinstance(trainer.accelerator, CUDAAccelerator)


def determinism_note(*, on_cuda: bool, deterministic: bool | str | None, resuming: bool) -> str | None:
    """What a run on CUDA without `trainer.deterministic=true` should be told, or None.

    CPU runs repeat bit for bit (docs/how-to/resume.md); GPU kernels that add in parallel
    (atomics in backward passes, split reductions in cuBLAS) do not, so a resumed GPU run is the same
    run in distribution only, unless torch is asked for deterministic algorithms."""
    if not on_cuda or deterministic is True:
        return None
    which = "this resumed run is" if resuming else "a resume of this run will be"
    return (
        f"trainer.deterministic={deterministic} on CUDA: {which} statistically, not bitwise, the same run as "
        "an uninterrupted one (nondeterministic GPU kernels); trainer.deterministic=true asks torch for "
        "deterministic algorithms (slower; untested on GPU here; vLLM's own kernels are not covered)"
    )


def note_determinism(trainer: L.Trainer, cfg: DictConfig, *, resuming: bool) -> None:
    """Log `determinism_note` once (rank 0): a warning when resuming, else information."""
    note = determinism_note(
        on_cuda=trains_on_cuda(trainer), deterministic=cfg.trainer.get("deterministic"), resuming=resuming
    )
    if note and rank_zero_only.rank == 0:
        (log.warning if resuming else log.info)(note)


def train_job(cfg: DictConfig, s) -> dict[str, float]:
    """`train`'s work on the checked settings `s`: the run's objects live in this frame and go with it."""
    keeps = set_up_memory(cfg, s)
    output_dir = Path(cfg.output_dir)
    resume = resolve_resume(s.run.resume_from, output_dir, identity(s))  # checked, before loading
    save_config(cfg, output_dir)
    L.seed_everything(s.run.seed, workers=True, verbose=False)
    set_float32_matmul_precision(s.run.float32_matmul_precision)

    task = build_task(s)
    planned = check_memory(cfg, s, task)  # a run predicted not to fit stops here, with the fix
    if s.run.plan:  # plan=true: the plan printed, no model loaded
        return {}
    if rank_zero_only.rank == 0:
        write_plan(planned, output_dir)
    facts = run_facts(s, task, planned)
    parts = build_run(s, task=task)

    summary = run_summary(s, output_dir=output_dir, facts=facts)
    stop = GracefulStop(output_dir / "checkpoints" / "last.ckpt")
    redraws, lines = progress_display(cfg)
    callbacks = run_callbacks(s, output_dir=output_dir, parts=parts, summary=summary, stop=stop,
                              resume=resume, keeps_freed_memory=keeps, progress_lines=lines)  # fmt: skip
    loggers = run_loggers(cfg, resume=resume)
    trainer = build_trainer(cfg, s, callbacks=callbacks, loggers=loggers, progress_bar=redraws)
    note_determinism(trainer, cfg, resuming=resume is not None)
    fit(trainer, parts, resume=resume, loggers=loggers)
    if s.run.export_policy and trainer.is_global_zero:
        mark_export(s.model, output_dir / export_folder_name(s.model))  # random weights: the record too
    # rank 0: the figures summary.md shows (the peak is read once); other ranks: their own
    result = summary.written or summary.summary(trainer)
    # after every output is written, since SLURM ends the job as soon as it is requeued
    if stop.requeue_wanted and trainer.is_global_zero:
        requeue_slurm_job(slurm_job_id())
    shutdown()
    return result


def set_up_memory(cfg: DictConfig, s) -> bool:
    """Threads, the run's peak and the allocator, before anything computes; True where glibc keeps
    freed memory (`keep_freed_memory`), which `TrimFreedMemory` then trims."""
    configure_threads(lightning_devices=lightning_launched_processes(cfg))  # before anything computes
    reset_peak_memory()  # the summary's peak starts here, not at an earlier multirun job's peak
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    keeps = keeps_freed_memory(s.run.keep_freed_memory, accelerator=accelerator,
                               cuda_available=cuda_available())  # fmt: skip
    if keeps:
        keep_freed_memory()
    return keeps


def save_config(cfg: DictConfig, output_dir: Path) -> None:
    """The run folder, with the resolved config in it (`config.yaml`)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if rank_zero_only.rank == 0:  # one copy from a multi-process run (Lightning reads the rank from the env)
        OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)


def run_facts(s, task, planned) -> dict[str, str]:
    """What the run states once, in the log and in summary.md: the task's facts (e.g. the sandbox
    isolation of a code task), random weights, the machine (`machine_line`), the memory plan's
    verdict."""
    facts = task.run_facts()  # e.g. the sandbox isolation of a code task: said once, and in summary.md
    facts |= random_weights_facts(s.model)  # a random-weights run can never pass for a trained one
    facts["machine"] = machine_line(on_cuda=s.on_cuda)  # what the numbers and the wall time were made on
    if planned is not None:
        facts["memory plan"] = verdict_line(planned).removeprefix("memory plan: ")
    for name, line in facts.items():
        (log.warning if name == "weights" else log.info)("%s: %s", name, line)
    return facts


def fit(trainer: L.Trainer, parts, *, resume: Resume | None, loggers: list) -> None:
    """Validate once (step 0) unless resuming, then train; the loggers are closed either way."""
    module, datamodule = parts.module, parts.datamodule
    if resume is None:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    else:
        log.info("resuming from %s", resume.path)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume.path if resume else None)
    finally:
        finish_loggers(loggers)
