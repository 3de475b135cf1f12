"""GPU determinism made explicit: `trainer.deterministic`, and the note a CUDA run without it gets.

CPU runs (and resumes) repeat bit for bit (tests/test_resume.py); on CUDA, without deterministic
kernels, a resumed run is the same run only in distribution, and the run says so once. The CUDA
condition is faked through `trains_on_cuda` (untested on GPU).
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
from hydra.utils import instantiate

from loorl.cli import train_job as cli
from loorl.cli.train import train
from loorl.cli.train_job import determinism_note, note_determinism
from loorl.cli.trainer_parts import trainer_precision


@pytest.mark.parametrize("deterministic", [False, None, "warn"])
@pytest.mark.parametrize("resuming", [False, True])
def test_the_note_is_for_cuda_without_deterministic_kernels(deterministic, resuming):
    note = determinism_note(on_cuda=True, deterministic=deterministic, resuming=resuming)
    assert note and "\n" not in note
    assert "statistically, not bitwise" in note and "trainer.deterministic=true" in note
    assert ("this resumed run" in note) is resuming


@pytest.mark.parametrize("resuming", [False, True])
def test_no_note_on_cpu_or_with_deterministic_kernels(resuming):
    for deterministic in (False, None, "warn", True):
        assert determinism_note(on_cuda=False, deterministic=deterministic, resuming=resuming) is None
    assert determinism_note(on_cuda=True, deterministic=True, resuming=resuming) is None


def _trainer(cfg) -> L.Trainer:
    return instantiate(cfg.trainer, logger=False, enable_progress_bar=False, precision=trainer_precision(cfg))


def _notes(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "statistically, not bitwise" in r.getMessage()]


def test_a_cpu_trainer_logs_no_note(quick_cfg, caplog):
    cfg = quick_cfg("trainer.accelerator=cpu")  # (the quick profile trains on CUDA where it is visible)
    trainer = _trainer(cfg)
    assert not cli.trains_on_cuda(trainer)
    with caplog.at_level(logging.INFO, logger=cli.log.name):
        note_determinism(trainer, cfg, resuming=True)
    assert _notes(caplog) == []


@pytest.mark.parametrize("resuming, level", [(True, logging.WARNING), (False, logging.INFO)])
def test_a_cuda_trainer_logs_the_note_once(monkeypatch, quick_cfg, caplog, resuming, level):
    monkeypatch.setattr(cli, "trains_on_cuda", lambda trainer: True)
    cfg = quick_cfg()
    with caplog.at_level(logging.INFO, logger=cli.log.name):
        note_determinism(_trainer(cfg), cfg, resuming=resuming)
    (record,) = _notes(caplog)
    assert record.levelno == level and "trainer.deterministic=False" in record.getMessage()


def test_a_deterministic_cuda_trainer_logs_no_note(monkeypatch, quick_cfg, caplog):
    monkeypatch.setattr(cli, "trains_on_cuda", lambda trainer: True)
    cfg = quick_cfg("trainer.deterministic=true")
    with caplog.at_level(logging.INFO, logger=cli.log.name):
        note_determinism(_trainer(cfg), cfg, resuming=True)
    assert _notes(caplog) == []


@pytest.mark.parametrize("name", ["default", "gpu"])
def test_deterministic_is_a_trainer_setting_off_by_default(quick_cfg, name):
    cfg = quick_cfg(f"trainer={name}")
    assert cfg.trainer.deterministic is False


def test_deterministic_true_reaches_lightning(quick_cfg):
    """Lightning's own switch: torch's deterministic algorithms and cuBLAS's workspace setting."""
    import os

    import torch

    before = torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        _trainer(quick_cfg("trainer.deterministic=true"))
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        if before[1] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[1]


def test_train_notes_before_it_validates_or_resumes(monkeypatch, quick_cfg):
    """`train` calls the note with its trainer and whether it resumes, before any training (the
    model is not built: stand-ins for the run's parts)."""
    from types import SimpleNamespace

    seen = []

    class Stop(Exception):
        pass

    def record_and_stop(trainer, cfg, *, resuming):
        seen.append((isinstance(trainer, L.Trainer), resuming))
        raise Stop

    parts = SimpleNamespace(datamodule=SimpleNamespace(engine=None), module=None, tokenizer=None)
    monkeypatch.setattr(cli, "build_run", lambda s, task: parts)
    monkeypatch.setattr(cli, "note_determinism", record_and_stop)
    with pytest.raises(Stop):
        train(quick_cfg("rl.steps=1", "export_policy=false", "trainer.enable_progress_bar=false"))
    assert seen == [(True, False)]
