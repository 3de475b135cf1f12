"""What `train` hands the Lightning Trainer: its callbacks (`run_callbacks`, with the run's summary,
`run_summary`), its loggers (`run_loggers`, a resumed run's earlier rows and wandb run carried over),
its progress display, its precision and the Trainer itself (`build_trainer`); `finish_loggers`
closes the loggers after `fit`."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from loorl.models.random_weights import export_folder_name
from loorl.models.sources import model_label
from loorl.rollout.engines.sync import EngineSync
from loorl.training.callbacks import (
    HFExport,
    PhaseMemory,
    RunSummary,
    SampleLog,
    TrimFreedMemory,
    rl_steps_done,
)
from loorl.training.checkpoints import AtomicCheckpointIO
from loorl.training.graceful_stop import GracefulStop, slurm_environment
from loorl.training.rank_checks import RankChecks
from loorl.training.resume import EpochRow, previous_metrics_rows, previous_wandb_run_id, replay_metrics_rows

if TYPE_CHECKING:
    from loorl.training.resume import Resume

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


def run_summary(s, *, output_dir: Path, facts: dict[str, str]) -> RunSummary:
    """The callback that writes summary.md, metrics.json and the plot, titled by estimator, task and
    model; `facts`: the lines it states as they are (`loorl.cli.train_job.run_facts`)."""
    return RunSummary(
        str(output_dir),
        title=f"{s.estimator.label} on {s.task['name']} ({model_label(s.model)})",
        pass_k=s.run.val_pass_k,
        facts=facts,
    )


def progress_display(cfg: DictConfig) -> tuple[bool, bool]:
    """(Lightning's progress bar redraws, `ProgressLines` prints occasional lines): with
    `trainer.enable_progress_bar`, the bar on a terminal, the lines elsewhere (CI, nohup)."""
    progress_bar = bool(cfg.trainer.enable_progress_bar)
    redraws = progress_bar and sys.stdout.isatty()
    return redraws, progress_bar and not redraws


def run_callbacks(
    s,
    *,
    output_dir: Path,
    parts,
    summary: RunSummary,
    stop: GracefulStop,
    resume: Resume | None,
    keeps_freed_memory: bool,
    progress_lines: bool,
) -> list[L.Callback]:
    """The run's callbacks, in the order they must run. `s`: the run's `loorl.config.Settings`;
    `parts`: `build_run`'s (the engine of its DataModule, its tokenizer); `progress_lines`: occasional
    lines instead of Lightning's redrawn bar (`ProgressLines`)."""
    checkpoints = output_dir / "checkpoints"
    callbacks = [
        RankChecks(output_dir, resume_step=None if resume is None else resume.epoch + 1),
        EngineSync(parts.datamodule.engine),
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
        callbacks.append(HFExport(str(output_dir / export_folder_name(s.model)), parts.tokenizer))
    if keeps_freed_memory and s.run.trim_freed_memory_every:
        callbacks.append(TrimFreedMemory(s.run.trim_freed_memory_every))
    if progress_lines:
        callbacks.append(ProgressLines(s.rl.steps))
    return callbacks


def run_loggers(cfg: DictConfig, *, resume: Resume | None) -> list:
    """The loggers of `cfg.logger`, each given the resolved config (CSV: hparams.yaml; wandb: its
    config). A resumed run's CSV logger starts with the interrupted run's rows up to its checkpoint
    (a new CSV logger replaces the file), and its wandb logger continues the same wandb run."""
    earlier_rows = []
    if resume is not None and rank_zero_only.rank == 0:
        earlier_rows = previous_metrics_rows(resume)
    if resume is not None and "wandb" in (cfg.logger or {}):
        continue_wandb_run(cfg.logger.wandb, previous_wandb_run_id(resume.path))
    loggers = [instantiate(c) for c in (cfg.logger or {}).values()]
    replay_metrics_rows(loggers, earlier_rows)
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return loggers


def build_trainer(
    cfg: DictConfig, s, *, callbacks: list[L.Callback], loggers: list, progress_bar: bool
) -> L.Trainer:
    """`cfg.trainer` with the run's callbacks, loggers, precision and checkpoint plugins."""
    return instantiate(
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


class ProgressLines(L.Callback):
    """One log line per validation (step, reward, held-out accuracy, elapsed time): progress for
    output that is not a terminal, where a progress bar's carriage-return redraws are noise."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.started = time.perf_counter()

    @rank_zero_only
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        step = rl_steps_done(trainer)
        parts = [f"step {step}/{self.total_steps}"]
        for key in ("rollout/reward", "val/accuracy", "val/pass_at_k"):
            if key in m and (key != "rollout/reward" or step > 0):
                parts.append(f"{key} {float(m[key]):.3f}")
        parts.append(f"{time.perf_counter() - self.started:.0f} s")
        logging.getLogger("loorl").info("  ".join(parts))  # the package's logger, as the run's other lines
