"""Stopping a run cleanly: `GracefulStop` (SIGTERM, SIGUSR1 or a first Ctrl-C finishes the RL step,
writes `last.ckpt` and stops) and SLURM's side of it: the job this process runs in, Lightning's
cluster environment without its own requeue, and `requeue_slurm_job` after a SIGUSR1.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)


REQUEUE_SIGNAL = signal.SIGUSR1  # SLURM's advance notice (`#SBATCH --signal=USR1@<seconds>`), as Lightning's


class GracefulStop(L.Callback):
    """SIGTERM (a scheduler's preemption notice), SIGUSR1 (SLURM's notice before the time limit) or a
    first Ctrl-C: finish the RL step under way, write `last.ckpt` and stop; the end of `fit` then writes
    the summary, plot and export as usual. A second Ctrl-C interrupts at once. Under several processes
    a signal on any rank stops all of them at the same step.

    SIGUSR1 inside a SLURM job also asks for the job to be requeued (`requeue_wanted`): `train` calls
    `requeue_slurm_job` once every output is written, and the job's script, run again by SLURM with
    `resume_from=auto`, continues from `last.ckpt`. This handler owns these signals: Lightning's own
    SLURM auto-requeue (which writes `hpc_ckpt_<n>.ckpt` and restores it without the run's earlier
    metrics) is turned off (`slurm_environment`), so one kind of checkpoint is written.

    Lightning's own SIGTERM handling stops after the running batch, before the step's end-of-epoch
    work (validation, checkpoint); the handlers here replace it during training and are restored
    afterwards.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, REQUEUE_SIGNAL)

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = Path(checkpoint)
        self.requested: str | None = None
        self.requeue_wanted = False
        self.saved_handlers: dict = {}

    def _request(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: now
        self.requested = signal.Signals(signum).name
        if signum == REQUEUE_SIGNAL and slurm_job_id() is not None:
            self.requeue_wanted = True
        then = "checkpoint, requeue the SLURM job and stop" if self.requeue_wanted else "checkpoint and stop"
        log.warning("%s: finishing this RL step, then %s (Ctrl-C again to stop now)", self.requested, then)

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread
        for sig in self.SIGNALS:
            self.saved_handlers[sig] = signal.signal(sig, self._request)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        stop = trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False)
        if stop and not trainer.should_stop:
            # every rank requeues (or not) as the ranks that were signalled ask; rank 0 acts on it
            self.requeue_wanted = trainer.strategy.reduce_boolean_decision(self.requeue_wanted, all=False)
            trainer.save_checkpoint(self.checkpoint)
            log.warning("stopped after RL step %d: %s written", trainer.current_epoch + 1, self.checkpoint)
            trainer.should_stop = True

    def _restore(self) -> None:
        for sig, handler in self.saved_handlers.items():
            signal.signal(sig, handler)
        self.saved_handlers.clear()

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()


# ---- SLURM ------------------------------------------------------------------------------------------
def slurm_job_id() -> str | None:
    """The SLURM job this process runs in (an array task as `<job>_<task>`), None outside SLURM."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID") or None


def slurm_environment() -> list:
    """Lightning's SLURM cluster environment without its auto-requeue, for the Trainer's plugins, when
    srun started this process (Lightning detects it the same way); else nothing. `GracefulStop` owns
    the requeue signal instead."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def requeue_slurm_job(job_id: str) -> bool:
    """`scontrol requeue <job>`: SLURM ends this job and queues it again (same job id, same script,
    SLURM_RESTART_COUNT one higher). The job must allow it (`#SBATCH --requeue`)."""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        log.error("could not requeue SLURM job %s (%s): resubmit the same script to continue", job_id, err)
        return False
    if done.returncode != 0:
        log.error("scontrol requeue %s failed (%s): resubmit the same script to continue", job_id,
                  (done.stderr or done.stdout).strip()[:200])  # fmt: skip
        return False
    log.warning("requeued SLURM job %s: it continues from its last checkpoint when it runs again", job_id)
    return True
