"""`train(cfg) -> metrics`: the whole run, separate from the `@hydra.main` wrapper so tests call it.

The settings are checked first (`check_config`), before the run's heavy libraries load: a bad setting
is one `error:` line about 4 s after the command, not 11. The run itself is `loorl.cli.train_job`."""

from __future__ import annotations

from omegaconf import DictConfig

from loorl.cli.console import run_cli
from loorl.config import check_config
from loorl.util.allocator import release_memory


def train(cfg: DictConfig, s=None) -> dict[str, float]:
    """Check the config (unless `s`, its checked settings, is given), build everything, validate once
    (step 0), train, write the outputs; then hand the job's memory back (`release_memory`), so that a
    multirun's next job in this process starts where this one did.

    Resuming (`resume_from`: a checkpoint, or `auto` for the newest under `output_dir`) skips the
    step-0 validation, whose result is in the checkpoint with the rest of the run's history."""
    s = check_config(cfg) if s is None else s
    from loorl.cli.train_job import train_job  # Lightning, transformers, the engines: once the settings hold

    try:
        return train_job(cfg, s)
    finally:  # after train_job's frame is gone: nothing of the job is referenced any more
        release_memory()


def main(cfg: DictConfig) -> dict[str, float]:
    """The CLI: a bad setting prints one `error:` line and exits 2, checked before the libraries that
    only the run needs are imported (`run_cli`'s `check`)."""
    return run_cli(train, cfg, check=check_config)
