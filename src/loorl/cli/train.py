"""`train(cfg) -> metrics`: the whole run, separate from the `@hydra.main` wrapper so tests call it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from loorl.build import build_run, build_task, identity
from loorl.cli.console import ProgressLines, run_cli
from loorl.cli.plan import check_memory, verdict_line, write_plan
from loorl.config import check_config
from loorl.models.random_weights import export_folder_name, mark_export, random_weights_facts
from loorl.models.sources import model_label
from loorl.parallel.distributed import shutdown
from loorl.parallel.launch import configure_threads, lightning_launched_processes
from loorl.rollout.engines.sync import EngineSync
from loorl.training.callbacks import HFExport, PhaseMemory, RunSummary, SampleLog, TrimFreedMemory
from loorl.training.checkpoints import (
    AtomicCheckpointIO,
    EpochRow,
    GracefulStop,
    previous_metrics_rows,
    previous_wandb_run_id,
    replay_metrics_rows,
    requeue_slurm_job,
    resolve_resume,
    slurm_environment,
    slurm_job_id,
)
from loorl.training.rank_checks import RankChecks
from loorl.util.allocator import keep_freed_memory, keeps_freed_memory, release_memory
from loorl.util.hardware import cuda_available, set_float32_matmul_precision
from loorl.util.peak_memory import reset_peak_memory

log = logging.getLogger(__name__)


def trainer_precision(cfg: DictConfig) -> str:
    """Lightning's precision for `trainer.precision=auto`: from the compute and master dtypes.

    Compute below the master dtype runs under autocast (`bf16-mixed`, or `16-mixed` with a loss
    scaler); weights already in the compute dtype need no cast (`32-true` leaves them as loaded).
    """
    if cfg.trainer.precision != "auto":
        return str(cfg.trainer.precision)
    if cfg.model.dtype == cfg.model.master_dtype:
        return "32-true"
    return {"bfloat16": "bf16-mixed", "float16": "16-mixed"}[cfg.model.dtype]


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


def train(cfg: DictConfig) -> dict[str, float]:
    """Check the config, build everything, validate once (step 0), train, write the outputs; then hand
    the job's memory back (`release_memory`), so that a multirun's next job in this process starts
    where this one did.

    Resuming (`resume_from`: a checkpoint, or `auto` for the newest under `output_dir`) skips the
    step-0 validation, whose result is in the checkpoint with the rest of the run's history."""
    try:
        return train_job(cfg)
    finally:  # after train_job's frame is gone: nothing of the job is referenced any more
        release_memory()


def train_job(cfg: DictConfig) -> dict[str, float]:
    """`train`'s work: the run's objects live in this frame and go with it."""
    s = check_config(cfg)
    configure_threads(lightning_devices=lightning_launched_processes(cfg))  # before anything computes
    reset_peak_memory()  # the summary's peak starts here, not at an earlier multirun job's peak
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    keeps = keeps_freed_memory(s.run.keep_freed_memory, accelerator=accelerator,
                               cuda_available=cuda_available())  # fmt: skip
    if keeps:
        keep_freed_memory()
    output_dir = Path(cfg.output_dir)
    resume = resolve_resume(s.run.resume_from, output_dir, identity(s))  # checked, before loading
    output_dir.mkdir(parents=True, exist_ok=True)
    if rank_zero_only.rank == 0:  # one copy from a multi-process run (Lightning reads the rank from the env)
        OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)
    L.seed_everything(s.run.seed, workers=True, verbose=False)
    set_float32_matmul_precision(s.run.float32_matmul_precision)

    task = build_task(s)
    planned = check_memory(cfg, s, task)  # a run predicted not to fit stops here, with the fix
    if s.run.plan:  # plan=true: the plan printed, no model loaded
        return {}
    if rank_zero_only.rank == 0:
        write_plan(planned, output_dir)
    facts = task.run_facts()  # e.g. the sandbox isolation of a code task: said once, and in summary.md
    facts |= random_weights_facts(s.model)  # a random-weights run can never pass for a trained one
    if planned is not None:
        facts["memory plan"] = verdict_line(planned).removeprefix("memory plan: ")
    for name, line in facts.items():
        (log.warning if name == "weights" else log.info)("%s: %s", name, line)
    parts = build_run(s, task=task)
    datamodule, module, tokenizer = parts.datamodule, parts.module, parts.tokenizer
    checkpoints = output_dir / "checkpoints"

    summary = RunSummary(
        str(output_dir),
        title=f"{s.estimator.label} on {s.task['name']} ({model_label(s.model)})",
        pass_k=s.run.val_pass_k,
        facts=facts,
    )
    stop = GracefulStop(checkpoints / "last.ckpt")
    callbacks = [
        RankChecks(output_dir, resume_step=None if resume is None else resume.epoch + 1),
        EngineSync(datamodule.engine),
        PhaseMemory(),  # before the summary, which reads what it logs
        summary,
        EpochRow(),  # before the callbacks that write checkpoints
        stop,
        SampleLog(str(output_dir / "samples.csv"), rows=s.run.sample_rows),
    ]
    if s.run.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoints,
                every_n_epochs=s.run.checkpoint_every,
                save_last=True,
                monitor="step",  # keep the newest `checkpoint_keep` (ModelCheckpoint's top-k by step)
                mode="max",
                save_top_k=s.run.checkpoint_keep,
                save_on_train_epoch_end=True,  # after the step's validation and RunSummary's record of it
            )
        )
    if s.run.export_policy:
        callbacks.append(HFExport(str(output_dir / export_folder_name(s.model)), tokenizer))
    if keeps and s.run.trim_freed_memory_every:
        callbacks.append(TrimFreedMemory(s.run.trim_freed_memory_every))
    progress_bar = bool(cfg.trainer.enable_progress_bar)
    if progress_bar and not sys.stdout.isatty():  # CI, nohup: occasional lines instead of redraws
        callbacks.append(ProgressLines(s.rl.steps))
        progress_bar = False
    earlier_rows = []  # the interrupted run's CSV rows up to its checkpoint (a new CSV logger replaces them)
    if resume is not None and rank_zero_only.rank == 0:
        earlier_rows = previous_metrics_rows(resume)
    if resume is not None and "wandb" in (cfg.logger or {}):
        continue_wandb_run(cfg.logger.wandb, previous_wandb_run_id(resume.path))
    loggers = [instantiate(c) for c in (cfg.logger or {}).values()]
    replay_metrics_rows(loggers, earlier_rows)
    for logger in loggers:  # the resolved config beside the metrics (CSV: hparams.yaml; wandb: its config)
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    trainer = instantiate(
        cfg.trainer,
        logger=loggers or False,
        callbacks=callbacks,
        precision=trainer_precision(cfg),
        enable_progress_bar=progress_bar,
        # checkpoint_every=0 means none: else Lightning adds its own ModelCheckpoint, which wrote the whole
        # state into <run>/csv/checkpoints/ at every RL step (1.6 GB a step for SmolLM2). A stop
        # (Ctrl-C, SIGTERM) still saves last.ckpt: that is trainer.save_checkpoint, not a callback
        enable_checkpointing=bool(s.run.checkpoint_every),
        plugins=[AtomicCheckpointIO(), *slurm_environment()],
    )
    note_determinism(trainer, cfg, resuming=resume is not None)
    if resume is None:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    else:
        log.info("resuming from %s", resume.path)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume.path if resume else None)
    finally:
        finish_loggers(loggers)
    if s.run.export_policy and trainer.is_global_zero:
        mark_export(s.model, output_dir / export_folder_name(s.model))  # random weights: the record too
    # rank 0: the figures summary.md shows (the peak is read once); other ranks: their own
    result = summary.written or summary.summary(trainer)
    # after every output is written, since SLURM ends the job as soon as it is requeued
    if stop.requeue_wanted and trainer.is_global_zero:
        requeue_slurm_job(slurm_job_id())
    shutdown()
    return result


def continue_wandb_run(wandb_cfg: DictConfig, run_id: str | None) -> None:
    """A resumed run logs into the wandb run it continues (same id, `resume="allow"`), as its CSV and
    summary continue; without an earlier wandb run, wandb starts one."""
    if run_id is None or wandb_cfg.get("id"):
        return
    with open_dict(wandb_cfg):
        wandb_cfg.id = run_id
        wandb_cfg.resume = "allow"
    log.info("continuing wandb run %s", run_id)


def finish_loggers(loggers: list) -> None:
    """Close each wandb run: Lightning leaves it open, and the next job of a multirun (same process)
    would otherwise log into it instead of starting its own."""
    for logger in loggers:
        if type(logger).__name__ == "WandbLogger" and logger._experiment is not None:
            logger.experiment.finish()


def main(cfg: DictConfig) -> dict[str, float]:
    """The CLI: a bad setting prints one `error:` line and exits 2."""
    return run_cli(train, cfg)
