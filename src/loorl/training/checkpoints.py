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
- `GracefulStop`: SIGTERM or a first Ctrl-C finishes the RL step, writes `last.ckpt` and stops.
"""

from __future__ import annotations

import contextlib
import csv
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
    """Lightning's torch.save checkpoint IO, written to a temporary file and renamed into place."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
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
            "model.lora.alpha": None if s.model.lora is None else s.model.lora.lora_alpha,
        },
    }


def lora_identity(lora) -> str | None:
    """What a checkpoint's adapters must match (`model.lora`'s shape), None for full weights. Checkpoints
    written before LoRA existed have no entry, which reads as None."""
    if lora is None:
        return None
    return f"r={lora.r} target_modules={','.join(lora.target_modules)}"


class Resume(NamedTuple):
    path: Path  # the checkpoint to load
    epoch: int  # the last epoch it holds (the interrupted run's CSV rows are kept up to it)


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
    return Resume(path, int(state["epoch"]))


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


def previous_metrics_rows(checkpoint: Path, last_epoch: int) -> list[dict[str, str]]:
    """The rows of the interrupted run's `csv/metrics.csv` up to and including epoch `last_epoch`
    (the checkpoint's), read before the new CSV logger replaces the file."""
    csv_file = Path(checkpoint).resolve().parent.parent / "csv" / "metrics.csv"
    if not csv_file.is_file():
        return []
    with csv_file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if r.get("epoch", "") != "" and int(float(r["epoch"])) <= last_epoch]


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


class GracefulStop(L.Callback):
    """SIGTERM (a scheduler's preemption notice) or a first Ctrl-C: finish the RL step under way, write
    `last.ckpt` and stop; the end of `fit` then writes the summary, plot and export as usual. A second
    Ctrl-C interrupts at once. Under several processes a signal on any rank stops all of them at the
    same step.

    Lightning's own SIGTERM handling stops after the running batch, before the step's end-of-epoch
    work (validation, checkpoint); the handlers here replace it during training and are restored
    afterwards.
    """

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = Path(checkpoint)
        self.requested: str | None = None
        self.saved_handlers: dict = {}

    def _request(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: now
        self.requested = signal.Signals(signum).name
        log.warning("%s: finishing this RL step, then checkpoint and stop (Ctrl-C again to stop now)",
                    self.requested)  # fmt: skip

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.saved_handlers[sig] = signal.signal(sig, self._request)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        stop = trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False)
        if stop and not trainer.should_stop:
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
