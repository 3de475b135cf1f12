"""Resuming a run: the checkpoint to continue from, and the interrupted run's logs carried over.

- `resolve_resume` turns `resume_from` (a path, `auto`, or null) into the checkpoint to load,
  checking it first: it exists, is a Lightning checkpoint, and was written by a run of the same
  model and optimizer (`loorl.training.run_identity.check_identity`). Each problem is one
  `ConfigError` line, before any model loads.
- `previous_metrics_rows` reads the interrupted run's `csv/metrics.csv` up to the checkpoint (with
  `EpochRow`'s copy of the checkpoint's own epoch), and `replay_metrics_rows` logs them again, so the
  resumed run's CSV covers the whole run; `previous_wandb_run_id` names the wandb run it continues.
"""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import NamedTuple

import lightning as L

from loorl.errors import ConfigError
from loorl.training.checkpoints import complete_checkpoints, read_checkpoint
from loorl.training.run_identity import IDENTITY_KEY, check_identity

log = logging.getLogger(__name__)


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
