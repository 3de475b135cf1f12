"""The learning-rate schedule (`lr_schedule`): its values by hand, its errors, and a run that follows it."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from loorl.errors import ConfigError
from loorl.settings import LRScheduleSettings
from loorl.training.lr_schedule import lr_scheduler


def _rates(schedule: LRScheduleSettings, total: int, lr: float = 1.0) -> list[float]:
    """The rate each of `total` optimizer steps uses."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = lr_scheduler(opt, schedule, total_steps=total)
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def test_constant_schedule_with_and_without_warmup():
    assert _rates(LRScheduleSettings(), 5, lr=3e-4) == pytest.approx([3e-4] * 5)
    assert _rates(LRScheduleSettings(warmup_steps=4), 6) == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1])


def test_linear_decay_to_zero():
    assert _rates(LRScheduleSettings(name="linear"), 4) == pytest.approx([1, 0.75, 0.5, 0.25])


def test_cosine_with_warmup_and_a_floor_by_hand():
    """Warm-up from the floor (transformers' warmup-stable-decay schedule), then half a cosine from
    the full rate to the floor over the remaining steps: factor = floor + (1 - floor) * w."""
    floor, warmup, total = 0.1, 2, 10
    rates = _rates(LRScheduleSettings(name="cosine", warmup_steps=warmup, min_lr_ratio=floor), total)
    expected = [floor + (1 - floor) * w for w in (0.0, 0.5)]  # warm-up: steps / warmup
    expected += [floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
                 for s in range(warmup, total)]  # fmt: skip
    assert rates == pytest.approx(expected)
    assert rates[2] == pytest.approx(1.0) and rates[-1] == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 - math.cos(math.pi / 8))
    )


def test_warmup_longer_than_the_run_is_all_warmup():
    assert _rates(LRScheduleSettings(name="cosine", warmup_steps=10), 4) == pytest.approx([0, 0.1, 0.2, 0.3])


def test_a_floor_without_decay_is_refused():
    with pytest.raises(ConfigError, match="lr_schedule.min_lr_ratio=0.1 with lr_schedule.name=constant"):
        LRScheduleSettings.from_cfg({"name": "constant", "min_lr_ratio": 0.1}, "lr_schedule")
    with pytest.raises(ConfigError, match="lr_schedule.name='step'"):
        LRScheduleSettings.from_cfg({"name": "step"}, "lr_schedule")


def test_a_run_logs_the_scheduled_rate_at_every_optimizer_step(quick_cfg, tmp_path):
    """The quick run (4 RL steps of 2 optimizer steps each) logs the rate each step used."""
    from loorl.cli.train import train

    cfg = quick_cfg(
        "lr_schedule.name=cosine", "lr_schedule.warmup_steps=2", "lr_schedule.min_lr_ratio=0.1",
        "optimizer.lr=1e-3", "rl.prompts_per_minibatch=4", "val_every=4", "checkpoint_every=0",
        "export_policy=false",
    )  # fmt: skip
    train(cfg)
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        logged = [float(r["train/lr"]) for r in csv.DictReader(f) if r.get("train/lr")]
    # train/lr is the rate of each RL step's last optimizer step: steps 1, 3, 5, 7 of 8
    schedule = LRScheduleSettings(name="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert logged == pytest.approx(_rates(schedule, 8, lr=1e-3)[1::2])
