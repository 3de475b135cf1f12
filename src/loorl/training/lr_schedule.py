"""The learning rate over a run's optimizer steps: `lr_schedule`'s settings as transformers'
warmup-stable-decay schedule (`wsd_arguments`, which the TRL benchmark peer gets too; `lr_scheduler`)."""

from __future__ import annotations

from loorl.settings import LRScheduleSettings


def wsd_arguments(schedule: LRScheduleSettings, *, total_steps: int) -> dict:
    """`schedule` over `total_steps` optimizer steps as the arguments of transformers'
    warmup-stable-decay schedule: linear warm-up, then constant (no decay), or linear or cosine decay
    to `min_lr_ratio` of the base rate over the rest. A warm-up longer than the run keeps its slope
    (the run never reaches the peak). The TRL benchmark peer gets the same arguments."""
    warmup = schedule.warmup_steps
    decay = 0 if schedule.name == "constant" else max(0, total_steps - warmup)
    return {
        "num_warmup_steps": warmup,
        "num_stable_steps": max(0, total_steps - warmup - decay),
        "num_decay_steps": decay,
        "decay_type": "cosine" if schedule.name == "constant" else schedule.name,
        "min_lr_ratio": schedule.min_lr_ratio,
    }


def lr_scheduler(optimizer, schedule: LRScheduleSettings, *, total_steps: int):
    """The learning-rate schedule (`wsd_arguments`), stepped once per optimizer step."""
    from transformers.optimization import get_wsd_schedule

    return get_wsd_schedule(optimizer, **wsd_arguments(schedule, total_steps=total_steps))
