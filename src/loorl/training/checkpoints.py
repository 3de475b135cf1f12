"""Checkpoints a run can trust: written atomically, found again after a crash, checked before use.

- `AtomicCheckpointIO` (one file: single process, DDP) and `atomic_directory` (FSDP's folder of
  shards) write under a temporary name in the same folder and rename into place, so a process
  killed while writing leaves the previous checkpoint as it was.
- `resolve_resume` turns `resume_from` (a path, `auto`, or null) into the checkpoint to load,
  checking it first: it exists, is a Lightning checkpoint, and was written by a run of the same
  model and optimizer (`run_identity`). Each problem is one `ConfigError` line, before any model
  loads. Settings that shape the run but not what can be loaded (seed, batch sizes, estimator,
  learning rate) are compared too: a difference is logged, since the run continues but is not the
  one it replaces.
- `previous_metrics_rows` reads the interrupted run's `csv/metrics.csv` up to the checkpoint, so the
  resumed run's CSV covers the whole run.
- `GracefulStop`: SIGTERM, SIGUSR1 or a first Ctrl-C finishes the RL step, writes `last.ckpt` and
  stops; SIGUSR1 in a SLURM job then requeues it (`requeue_slurm_job`).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from loorl.errors import ConfigError

log = logging.getLogger(__name__)

SHARDED_METADATA = "meta.pt"  # Lightning's file of non-tensor state in a distributed checkpoint folder
IDENTITY_KEY = "loorl"  # where a checkpoint keeps the identity of the run that wrote it


# ---- writing -------------------------------------------------------------------------------------
class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch.save checkpoint IO, streamed to a temporary file and renamed into place.

    By hand rather than `TorchCheckpointIO.save_checkpoint`: Lightning's `_atomic_save` serializes the
    whole checkpoint into an in-memory buffer and then copies it once more to write it, twice the
    checkpoint's size in memory for a moment (SmolLM2 with AdamW, a 1.6 GB checkpoint: the run's peak
    went from 3.8 to 5.2 GB while `last.ckpt` was written)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:  # as Lightning's
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(checkpoint, tmp)  # streamed: the file, not memory, holds the serialized bytes
            os.replace(tmp, target)  # atomic on POSIX: readers see the old file or the new one
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)


@contextlib.contextmanager
def atomic_directory(target: Path, *, is_writer: bool, barrier) -> Iterator[Path]:
    """A temporary folder beside `target` for every rank to write into; afterwards rank 0 swaps it
    into place (old folder renamed aside, new one renamed in, old one removed). A kill before the
    swap leaves the old checkpoint; one inside the swap leaves it under `<name>.old`, which
    `complete_checkpoints` still finds. `barrier()` synchronises the ranks."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    yield tmp
    barrier()
    if is_writer:
        old = target.with_name(f"{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


# ---- reading -------------------------------------------------------------------------------------
def read_checkpoint(path: Path) -> dict:
    """The checkpoint's non-tensor state (for a file, tensors are memory-mapped, not read)."""
    path = Path(path)
    if path.is_dir():
        meta = path / SHARDED_METADATA
        if not meta.is_file():
            raise ValueError(f"a folder without {SHARDED_METADATA}")
        return torch.load(meta, map_location="cpu", weights_only=False)
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a truncated one is not one
        raise ValueError("not a complete torch.save file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - truncated zip, pickle garbage, not a torch file at all
        raise ValueError(str(err).splitlines()[0][:120] if str(err) else type(err).__name__) from None
    if not isinstance(state, dict) or "global_step" not in state or "state_dict" not in state:
        raise ValueError("a torch file without a Lightning checkpoint's global_step and state_dict")
    return state


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(global step, path) of every readable checkpoint under `<run_dir>/checkpoints`, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not (path.suffix == ".ckpt" or path.name.endswith(".ckpt.old")):
            continue
        try:
            found.append((int(read_checkpoint(path)["global_step"]), path))
        except (ValueError, KeyError, OSError):
            log.warning("skipping unreadable checkpoint %s", path)
    return sorted(found, key=lambda item: (item[0], item[1].name == "last.ckpt"))


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


class Resume(NamedTuple):
    path: Path  # the checkpoint to load
    epoch: int  # the last epoch it holds (the interrupted run's CSV rows are kept up to it)
    epoch_row: dict | None = None  # that epoch's training row, as `EpochRow` saved it


def resolve_resume(resume_from: str | None, output_dir: Path, identity: dict) -> Resume | None:
    """The checkpoint to resume from, checked; None to start fresh. ConfigError on bad input."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        if not Path(output_dir).is_dir():
            raise ConfigError(
                f"resume_from=auto looks for checkpoints under output_dir={output_dir}, which does not "
                "exist: pass the folder of the run to continue (output_dir=... or hydra.run.dir=...)"
            )
        found = complete_checkpoints(output_dir)
        if not found:
            log.info("resume_from=auto: no checkpoint under %s, starting fresh", output_dir)
            return None
        path = found[-1][1]
        log.info("resume_from=auto: resuming from %s (step %d)", path, found[-1][0])
    else:
        path = Path(os.path.expanduser(resume_from))
        if not path.exists():
            raise ConfigError(
                f"resume_from={resume_from} does not exist: point it at a checkpoint "
                "(<run>/checkpoints/last.ckpt) or use resume_from=auto"
            )
    try:
        state = read_checkpoint(path)
    except ValueError as err:
        raise ConfigError(
            f"resume_from={path} is not a Lightning checkpoint ({err}): point it at a .ckpt written by a "
            "loorl run (<run>/checkpoints/last.ckpt)"
        ) from None
    check_identity(path, state.get(IDENTITY_KEY), identity)
    saved_row = (state.get("callbacks") or {}).get(EpochRow.__name__, {}).get("row")
    return Resume(path, int(state["epoch"]), saved_row)


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


def previous_metrics_rows(resume: Resume) -> list[dict[str, str]]:
    """The rows of the interrupted run's `csv/metrics.csv` up to and including the checkpoint's epoch,
    read before the new CSV logger replaces the file; the checkpoint's own copy of that epoch's row
    (`EpochRow`, read by `resolve_resume`) where the CSV lacks it (a kill between the two writes)."""
    last_epoch, saved = resume.epoch, resume.epoch_row
    csv_file = Path(resume.path).resolve().parent.parent / "csv" / "metrics.csv"
    rows = []
    if csv_file.is_file():
        with csv_file.open(newline="") as f:
            rows = list(csv.DictReader(f))
    rows = [r for r in rows if r.get("epoch", "") != "" and int(float(r["epoch"])) <= last_epoch]
    if saved and saved["epoch"] == last_epoch and not _has_row(rows, saved):
        rows.append({"epoch": str(saved["epoch"]), "step": str(saved["step"])} | {
            k: repr(v) for k, v in saved["values"].items()
        })  # fmt: skip
    return rows


def previous_wandb_run_id(checkpoint: Path) -> str | None:
    """The id of the newest wandb run in the run folder that wrote `checkpoint` (`wandb/run-<time>-<id>`,
    or `offline-run-<time>-<id>`), so that a resumed run logs into the same wandb run; None if none."""
    runs = sorted(
        (Path(checkpoint).resolve().parent.parent / "wandb").glob("*run-*-*"),
        key=lambda p: p.name.split("run-", 1)[1],  # by start time, offline or not
    )
    return runs[-1].name.rsplit("-", 1)[1] if runs else None


def _has_row(rows: list[dict[str, str]], saved: dict) -> bool:
    """Whether the CSV rows hold the saved epoch row (its epoch, with its first metric filled in)."""
    key = next(iter(saved["values"]), None)
    return key is None or any(r["epoch"] == str(saved["epoch"]) and r.get(key, "") != "" for r in rows)


class EpochRow(L.Callback):
    """The training metrics of the epoch a checkpoint ends with, kept in the checkpoint.

    Lightning writes an epoch's reduced training metrics to the loggers after the callbacks'
    `on_train_epoch_end`, where the epoch's checkpoint is saved: a process killed between the two leaves a
    checkpoint whose last step has no row in `csv/metrics.csv`. With the row in the checkpoint the resumed
    run's CSV still holds every step once (`previous_metrics_rows`). Listed before the checkpointing
    callbacks, so that its row is the one of the epoch they save."""

    def __init__(self) -> None:
        self.row: dict | None = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # what the logger connector logs once the epoch-end hooks are done (Lightning 2.x, not public API)
        logged = trainer._logger_connector.metrics["log"]
        values = {k: float(v) for k, v in logged.items() if k != "epoch"}
        # the step Lightning logs the epoch's row at (its `_batches_that_stepped - 1`)
        self.row = {"epoch": trainer.current_epoch, "step": trainer.global_step - 1, "values": values}

    def state_dict(self) -> dict:
        return {"row": self.row}

    def load_state_dict(self, state: dict) -> None:
        self.row = None  # only an interrupted run's CSV needs it, and resolve_resume reads it there


def replay_metrics_rows(loggers: list, rows: list[dict[str, str]]) -> None:
    """Log the earlier rows again into the run's CSV loggers (other loggers keep their own files)."""
    from lightning.pytorch.loggers import CSVLogger

    for logger in loggers:
        if not isinstance(logger, CSVLogger):
            continue
        for row in rows:
            values = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
            values["epoch"] = int(values["epoch"])  # as Lightning writes it
            logger.log_metrics(values, step=int(float(row["step"])))
        logger.save()


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
