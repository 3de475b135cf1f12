"""Honest timers on GPUs, and glibc's freed-memory setting only where it pays (CPU training).

A phase timed without waiting for CUDA measures kernel launches; the phase clock synchronises at
each boundary when this process uses CUDA and never on CPU. `keep_freed_memory: auto` turns the
allocator setting on only when training on the CPU. (The CUDA paths are faked here: untested on GPU.)
"""

from __future__ import annotations

import pytest
import torch

from loorl.config import check_config
from loorl.util import profiling
from loorl.util.allocator import keeps_freed_memory
from loorl.util.profiling import PhaseClock


@pytest.fixture
def synchronizations(monkeypatch) -> list[int]:
    """Calls of torch.cuda.synchronize, counted instead of made."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    return calls


def _three_phases(clock: PhaseClock) -> None:
    with clock.phase("forward"):
        torch.ones(4).sum()
    with clock.phase("backward"):
        pass
    with clock.phase("forward"):
        pass


def test_a_cpu_run_never_synchronises(monkeypatch, synchronizations):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # as in any CPU run
    clock = PhaseClock()
    _three_phases(clock)
    assert synchronizations == []
    assert set(clock.pop()) == {"perf/forward_seconds", "perf/backward_seconds"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_is_not_in_use_on_this_machine():
    assert not profiling.cuda_in_use()


def test_with_cuda_in_use_every_phase_boundary_synchronises(monkeypatch, synchronizations):
    monkeypatch.setattr(profiling, "cuda_in_use", lambda: True)
    _three_phases(PhaseClock())
    assert len(synchronizations) == 6  # before the start and before the stop of each of 3 phases


def test_the_synchronisation_sits_inside_the_timed_span(monkeypatch):
    """The wait before the stop is charged to the phase (what its kernels took), the wait before the
    start is not (what earlier phases queued)."""
    monkeypatch.setattr(profiling, "cuda_in_use", lambda: True)
    ticks = iter(range(100))
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: float(next(ticks)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: next(ticks))  # each wait: one tick
    clock = PhaseClock()
    with clock.phase("backward"):
        pass
    # ticks: 0 = the wait before the start, 1 = start, 2 = the wait before the stop, 3 = stop
    assert clock.pop() == {"perf/backward_seconds": 2.0}


def test_an_explicit_setting_wins(monkeypatch, synchronizations):
    monkeypatch.setattr(profiling, "cuda_in_use", lambda: True)
    _three_phases(PhaseClock(sync_cuda=False))
    assert synchronizations == []
    _three_phases(PhaseClock(sync_cuda=True))
    assert len(synchronizations) == 6


# ---- keep_freed_memory --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "setting, accelerator, cuda, expected",
    [
        ("auto", "cpu", False, True),
        ("auto", "cpu", True, True),  # a CPU run on a GPU machine
        ("auto", "auto", False, True),  # Lightning picks the CPU
        ("auto", "auto", True, False),  # Lightning picks CUDA
        ("auto", "gpu", True, False),
        ("auto", "cuda", True, False),
        (True, "gpu", True, True),  # forced
        (False, "cpu", False, False),
    ],
)
def test_keep_freed_memory_auto_means_cpu_training_only(setting, accelerator, cuda, expected):
    assert keeps_freed_memory(setting, accelerator=accelerator, cuda_available=cuda) is expected


def test_keep_freed_memory_defaults_to_auto_and_takes_true_false(quick_cfg):
    assert check_config(quick_cfg()).run.keep_freed_memory == "auto"
    assert check_config(quick_cfg("trainer=gpu")).run.keep_freed_memory == "auto"
    for value in ("true", "false"):
        setting = check_config(quick_cfg(f"keep_freed_memory={value}")).run.keep_freed_memory
        assert setting is (value == "true")


def test_keep_freed_memory_refuses_other_values_in_one_line(quick_cfg):
    from loorl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        check_config(quick_cfg("keep_freed_memory=sometimes"))
    message = str(err.value)
    assert "\n" not in message and "keep_freed_memory='sometimes'" in message and "'auto'" in message


def test_train_asks_the_allocator_only_when_training_on_cpu(monkeypatch, quick_cfg):
    """`train` consults `keeps_freed_memory` with the trainer's accelerator: a GPU trainer under
    `auto` leaves glibc alone (the run itself is stopped right after the decision)."""
    from loorl.cli import train_job as cli
    from loorl.cli.train import train

    taken = []

    class Stop(Exception):
        pass

    def stop_after_allocator(*a, **k):
        raise Stop

    monkeypatch.setattr(cli, "keep_freed_memory", lambda: taken.append(True))
    monkeypatch.setattr(cli, "resolve_resume", stop_after_allocator)
    for overrides, cuda, expected in (([], False, [True]), (["trainer=gpu"], True, [])):
        taken.clear()
        monkeypatch.setattr(cli, "cuda_available", lambda cuda=cuda: cuda)
        with pytest.raises(Stop):
            train(quick_cfg(*overrides))
        assert taken == expected, overrides


def test_trim_freed_memory_every_composes_and_sets_the_steps_after_which_memory_goes_back(quick_cfg):
    """`trim_freed_memory_every` (default 5): after every 5th RL step the kept heap's free pages go
    back to the OS (`TrimFreedMemory`); 0 never; a negative count is a one-line error."""
    from loorl.errors import ConfigError
    from loorl.training.callbacks import trims_after

    assert check_config(quick_cfg()).run.trim_freed_memory_every == 5
    assert check_config(quick_cfg("trim_freed_memory_every=0")).run.trim_freed_memory_every == 0
    with pytest.raises(ConfigError) as err:
        check_config(quick_cfg("trim_freed_memory_every=-1"))
    assert "\n" not in str(err.value) and "trim_freed_memory_every" in str(err.value)
    assert [step for step in range(12) if trims_after(step, 5)] == [4, 9]  # 0-based: after steps 5, 10
    assert [step for step in range(4) if trims_after(step, 1)] == [0, 1, 2, 3]
    assert not any(trims_after(step, 0) for step in range(12))
