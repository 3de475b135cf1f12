"""Every device-dependent default follows the device the run trains on (`trainer.accelerator`), not
whether a GPU exists: a run pinned to the CPU on a GPU node is a CPU run (HF engine, eager decoding
attention for wide models, the measured CPU compute dtype, the reward model on the CPU), and a GPU
run is a GPU run. CUDA is faked where it is absent (`torch.cuda.is_available`)."""

from __future__ import annotations

import pytest
import torch

from loorl.util import hardware


@pytest.mark.parametrize(
    ("accelerator", "available", "expected"),
    [
        ("cpu", True, False),
        ("cpu", False, False),
        ("gpu", False, True),
        ("cuda", True, True),
        ("auto", True, True),
        ("auto", False, False),
    ],  # fmt: skip
)
def test_uses_cuda_follows_the_accelerator_before_the_machine(accelerator, available, expected):
    assert hardware.uses_cuda(accelerator, available=available) is expected


@pytest.fixture
def gpu_node(monkeypatch):
    """torch reports a CUDA device (none is touched by what these tests run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "faked")
    hardware.fast_compute_dtype.cache_clear()
    yield
    hardware.fast_compute_dtype.cache_clear()


def test_a_cpu_pinned_run_on_a_gpu_node_makes_cpu_choices(gpu_node, quick_cfg, monkeypatch):
    from loorl.config import load_settings
    from loorl.rewards.model import reward_device
    from loorl.rollout.engines.factory import resolve_engine
    from loorl.rollout.engines.hf_engine import hf_decode

    monkeypatch.setattr("loorl.rollout.engines.factory.vllm_installed", lambda: True)
    s = load_settings(quick_cfg("trainer.accelerator=cpu", "rollout=auto"))
    assert s.accelerator == "cpu" and not s.on_cuda
    engine, why = resolve_engine("auto", cuda=s.on_cuda)  # vllm installed, yet the faster engine
    assert engine == "hf" and "faster" in why and "generation.md" in why
    assert hf_decode("auto", cuda=s.on_cuda) == "dynamic"
    assert reward_device("cpu") == "cpu"
    # the CPU's own measured choice, not CUDA's bf16 support
    assert hardware.fast_compute_dtype("cpu") == hardware.dtype_for_speedup(hardware.bf16_speedup())
    # the same node with the trainer on the GPU
    gpu = load_settings(quick_cfg("trainer=gpu", "rollout=auto"))
    assert gpu.on_cuda and resolve_engine("auto", cuda=gpu.on_cuda)[0] == "vllm"
    assert hf_decode("auto", cuda=gpu.on_cuda) == "compiled"
    assert hardware.fast_compute_dtype("gpu") == "bfloat16" and reward_device("gpu") == "cuda"
    assert reward_device("auto") == "cuda" and reward_device("cuda:1") == "cuda:1"


def test_the_reward_models_device_follows_the_trainer(quick_cfg):
    from loorl.rewards.model import reward_device

    cfg = quick_cfg("reward=model", "reward.functions.rm.fn.path=/x", "trainer.accelerator=cpu")
    assert cfg.reward.functions.rm.fn.device == "cpu" and reward_device("cpu") == "cpu"
    assert quick_cfg("reward=model", "reward.functions.rm.fn.path=/x").reward.functions.rm.fn.device == "auto"


def test_the_smollm2_recipes_dtype_follows_the_trainer(default_cfg, gpu_node):
    """`model.dtype: ${loorl.fast_dtype:${trainer.accelerator}}`: a CPU-pinned run measures the CPU."""
    cpu = default_cfg("experiment=smollm2_arithmetic", "trainer.accelerator=cpu").model.dtype
    assert cpu == hardware.dtype_for_speedup(hardware.bf16_speedup())
    assert default_cfg("experiment=smollm2_arithmetic", "trainer=gpu").model.dtype == "bfloat16"


def test_the_smollm2_recipes_micro_batch_follows_the_trainer(default_cfg):
    """`${loorl.by_device:...}`: 256 packed tokens on the CPU (its memory), the whole step in one packed
    pass on CUDA (an H200: 0.41 s a step against 0.91 s at 256). Resolves without touching CUDA."""
    cpu = default_cfg("experiment=smollm2_arithmetic", "trainer.accelerator=cpu")
    assert cpu.rl.microbatch_tokens == 256
    assert default_cfg("experiment=smollm2_arithmetic", "trainer=gpu").rl.microbatch_tokens == 8192
    chosen = default_cfg("experiment=smollm2_arithmetic", "rl.microbatch_tokens=512")
    assert chosen.rl.microbatch_tokens == 512
    assert default_cfg("experiment=smollm2_arithmetic_lora", "trainer=gpu").rl.microbatch_tokens == 8192
