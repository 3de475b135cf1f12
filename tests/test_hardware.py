"""The compute dtype a recipe picks from what the machine can do (loorl.util.hardware)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from fixtures import child_env
from loorl.util.hardware import (
    TF32_HINTS,
    bf16_speedup,
    cpu_capability,
    cpu_model,
    dtype_for_speedup,
    fast_compute_dtype,
    fastest_interleaved,
    has_bf16_units,
    machine_line,
    matmul_flops_per_s,
    matmul_seconds,
    set_float32_matmul_precision,
)

PROBE = (
    "from loorl.util.hardware import fast_compute_dtype, cpu_capability; "
    "print(fast_compute_dtype(), cpu_capability())"
)


def _probe_in(env: dict[str, str]) -> list[str]:
    """The CPU's choice in a fresh process (CUDA hidden: on a GPU node a CUDA device decides first)."""
    env = child_env(CUDA_VISIBLE_DEVICES="", **env)  # loorl importable where it is not installed (GPU node)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_the_choice_follows_the_measured_speed():
    """bf16 exactly when its product beats float32 by the margin: the rule at hand values, and the
    process's one measurement (the fastest of 5 timed products each; the two CPUs seen measure
    0.03x and 2-6x, far on either side of 1.5x)."""
    assert [dtype_for_speedup(x) for x in (0.03, 1.49, 1.5, 6.2)] == [
        "float32",
        "float32",
        "bfloat16",
        "bfloat16",
    ]
    if not torch.cuda.is_available():
        assert fast_compute_dtype() == dtype_for_speedup(bf16_speedup())
    assert matmul_seconds(torch.float32, size=64, reps=2) > 0
    assert matmul_flops_per_s(torch.float32, size=64, reps=2) > 0


def test_a_stall_over_one_products_calls_does_not_move_the_interleaved_minima():
    """The probe's products take turns for at least `min_seconds`: a 160 ms stretch in which every call
    runs 10x slower (another tenant on the cores), beginning at the second product's first timed
    call, covers all of its 5 rounds; the first product's warm-up and first timed call escape it.
    Stopped at 5 rounds the minima read 2 ms against 10 ms (the ratio 0.2x, the stall's); going on
    until 0.4 s have passed, the calls after the stall give both their true minima back."""

    def run(min_seconds: float) -> dict[str, float]:
        stall = {"ends": None}
        calls = {"a": 0, "b": 0}

        def product(name: str, ms: float):
            def call():
                if stall["ends"] is None and name == "b" and calls["b"] == 1:  # b's first timed call
                    stall["ends"] = time.perf_counter() + 0.16
                slow = stall["ends"] is not None and time.perf_counter() < stall["ends"]
                time.sleep(ms / 1000 * (10 if slow else 1))
                calls[name] += 1

            return call

        return fastest_interleaved(
            {"a": product("a", 2), "b": product("b", 1)}, reps=5, min_seconds=min_seconds
        )

    short = run(min_seconds=0.0)
    assert short["a"] / short["b"] < 0.5  # the stall decided: b looks 5x slower than a
    best = run(min_seconds=0.4)
    assert best["a"] == pytest.approx(0.002, abs=0.001) and best["b"] == pytest.approx(0.001, abs=0.001)
    assert best["a"] / best["b"] > 1.3  # the products' own ratio (2x), not the stall's


def test_a_cpu_without_bf16_units_gets_float32():
    """`ONEDNN_MAX_CPU_ISA=AVX2` hides bf16 units from oneDNN (what an AVX2-only CPU has): float32."""
    dtype, capability = _probe_in({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert (dtype, capability) == ("float32", "AVX2")


def test_the_reported_capability_follows_aten_cpu_capability():
    assert _probe_in({"ATEN_CPU_CAPABILITY": "default"})[1] == "DEFAULT"
    assert cpu_capability() == str(torch.backends.cpu.get_cpu_capability())


def test_the_experiment_resolves_the_dtype_per_machine(default_cfg):
    cfg = default_cfg("experiment=smollm2_arithmetic")
    assert cfg.model.dtype == fast_compute_dtype() == cfg.model.ref_dtype


# ---- float32_matmul_precision ----------------------------------------------------------------------


def test_float32_matmul_precision_defaults_to_highest_and_refuses_others_in_one_line(quick_cfg):
    from loorl.config import check_config
    from loorl.errors import ConfigError

    assert check_config(quick_cfg()).run.float32_matmul_precision == "highest"
    assert check_config(quick_cfg("float32_matmul_precision=high")).run.float32_matmul_precision == "high"
    with pytest.raises(ConfigError) as err:
        check_config(quick_cfg("float32_matmul_precision=tf32"))
    message = str(err.value)
    assert "\n" not in message and "float32_matmul_precision='tf32'" in message and "'high'" in message


def test_the_precision_is_set_and_the_hints_to_change_it_leave_the_log(caplog):
    """Seen on an H200: inductor warns at every compile and Lightning logs a line per run while float32
    products run at 'highest'. Once the setting chose, neither reaches the log; other lines do."""
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    before = torch.get_float32_matmul_precision()
    try:
        set_float32_matmul_precision("high")
        assert torch.get_float32_matmul_precision() == "high"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            set_float32_matmul_precision("highest")
            warnings.warn(f"{TF32_HINTS[0]}. Consider setting it to 'high'", stacklevel=1)
            warnings.warn("another warning", stacklevel=1)
        assert torch.get_float32_matmul_precision() == "highest"
        assert [str(w.message) for w in seen] == ["another warning"]
        with caplog.at_level(logging.INFO):
            rank_zero_info(f"A CUDA device ('H200') with Tensor Cores. {TF32_HINTS[1]}('high')`")
            rank_zero_info("a line that stays")
        assert "a line that stays" in caplog.text and "Tensor Cores" not in caplog.text
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_inductor_cache_is_one_per_cpu_capability_unless_the_user_chose_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from loorl.util.hardware import cpu_capability, inductor_cache_for_this_cpu

    own = f"{default_cache_dir()}_{cpu_capability().lower()}"
    # unset; torch's default that torch itself wrote; the rule's choice in a parent at another capability
    for before in (None, default_cache_dir(), f"{default_cache_dir()}_another"):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        assert inductor_cache_for_this_cpu() == own and os.environ["TORCHINDUCTOR_CACHE_DIR"] == own
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache_for_this_cpu() == str(tmp_path / "mine")


XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
EPYC_AVX2 = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_the_machine_line_names_the_cpu_its_kernels_and_its_bf16_units():
    """What a run keeps as `machine` (summary.md, metrics.json, a study's records): by hand from two
    machines' /proc/cpuinfo, and this one's own line."""
    assert cpu_model(XEON) == "Intel Xeon" and has_bf16_units(XEON)
    assert cpu_model(EPYC_AVX2) == "AMD EPYC" and not has_bf16_units(EPYC_AVX2)
    assert not has_bf16_units("flags\t\t: avx512f avx512_bf16x\n")  # a flag, not a substring
    line = machine_line()
    assert f"{cpu_capability()} kernels" in line and f"torch {torch.__version__}" in line
    assert ("no bf16 units" in line) != has_bf16_units()
    assert line.startswith(cpu_model() + ", ") and " cores, " in line


def test_the_machine_line_names_gpus_only_for_a_run_on_cuda(monkeypatch):
    """Naming a GPU initialises CUDA: a CPU run on a GPU node must not (`cuda_in_use` stays False), so
    the GPUs are named only with `on_cuda`, grouped by name."""

    def refuse(*_):
        raise AssertionError("CUDA touched by a CPU run")

    monkeypatch.setattr(torch.cuda, "get_device_name", refuse)
    monkeypatch.setattr(torch.cuda, "device_count", refuse)
    assert "H100" not in machine_line()
    names = ["NVIDIA H100", "NVIDIA H100", "NVIDIA A10"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    line = machine_line(on_cuda=True)
    assert line.endswith(f"NVIDIA H100 x2, NVIDIA A10 x1, torch {torch.__version__}")
