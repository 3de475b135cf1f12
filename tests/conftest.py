"""Shared fixtures: one way to build a config (lightning-hydra-template's pattern).

- `make_config(*overrides)` (package scope): `conf/train.yaml` with overrides, its output in a
  throwaway folder; `quick_config(*overrides)` the same on the quick profile (`debug=quick`, the
  one `python src/train.py debug=quick` runs), with the session's model cache.
- `default_cfg(*overrides)` and `quick_cfg(*overrides)` (per test): the same, writing under the test's
  own `tmp_path` (`<tmp_path>/run`).

The quick profile samples with the HF engine (`rollout=hf`) wherever it runs: `rollout=auto` would take
vLLM on a GPU node that has it, one engine per test at half the GPU's memory. Tests about vLLM ask for
`rollout=vllm`. What a test needs from the machine (vllm, wandb, the package index, CUDA) and the
overrides that pin a run to the CPU are in tests/fixtures.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loorl.config import compose_config
from loorl.util.onednn import cap_onednn_primitive_cache

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
cap_onednn_primitive_cache()  # before any test's first bf16 product, and in the runs the tests start
QUICK = ("debug=quick", "rollout=hf")  # the tests' base profile


def xdist_threads(*, cpus: int, workers: int) -> int:
    """CPU threads for each of `workers` pytest-xdist processes sharing `cpus` cores (at least 1)."""
    return max(1, cpus // max(1, workers))


def _share_the_cores_under_xdist() -> None:
    """Under pytest-xdist each worker's torch (and, through OMP_NUM_THREADS, each process it starts)
    takes its share of the cores, unless OMP_NUM_THREADS is set already. Left alone, every worker starts
    one thread per core: `-n 14` on a 16-core GPU node means 224 threads on 16 cores, and every CPU-bound
    test (model builds, training runs, CLI start-ups) slows down as much, into its timeout."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = xdist_threads(cpus=os.cpu_count() or 1, workers=int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


_share_the_cores_under_xdist()

# The files that take longest, longest first (each 80-200 s of test time in a 2-core AVX2 EPYC's run,
# `--durations=0`): they are collected first. pytest-xdist's loadfile hands the files out in collection
# order, so a long file handed out last keeps one worker busy while the other has nothing left to do
LONGEST_FIRST = (
    "test_distributed.py", "test_resume.py", "test_study.py", "test_async.py", "test_reasoning_gym_run.py",
    "test_training.py", "test_default_run.py", "test_vllm_server.py", "test_configs.py", "test_plugins.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    """The LONGEST_FIRST files first, in that order; the rest after them in their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One cache for the session: the quick tiny model is built once and reused by every test.
    `LOORL_TEST_MODEL_CACHE`: a folder kept across sessions instead (a developer rerunning slow tests
    whose warm starts take minutes, e.g. `experiment=tiny_sum_calculator`'s); CI leaves it unset."""
    if folder := os.environ.get("LOORL_TEST_MODEL_CACHE"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        return Path(folder)
    return tmp_path_factory.mktemp("model_cache")


@pytest.fixture(scope="package")
def make_config(tmp_path_factory):
    """`make_config(*overrides, output_dir=...)`: the default config (output in a shared folder)."""
    unused = tmp_path_factory.mktemp("out")

    def make(*overrides: str, output_dir: str | Path = unused):
        return compose_config(f"output_dir={output_dir}", *overrides)

    return make


@pytest.fixture(scope="package")
def quick_config(make_config, model_cache):
    """`quick_config(*overrides, output_dir=...)`: the quick profile with the session's model cache and
    the HF engine (see the module's docstring); overrides win."""

    def make(*overrides: str, **kwargs):
        return make_config(*QUICK, f"model.cache_dir={model_cache}", *overrides, **kwargs)

    return make


@pytest.fixture
def default_cfg(make_config, tmp_path):
    """`default_cfg(*overrides)`: the default config writing into `<tmp_path>/run`."""
    return lambda *overrides: make_config(*overrides, output_dir=tmp_path / "run")


@pytest.fixture
def quick_cfg(quick_config, tmp_path):
    """`quick_cfg(*overrides)`: the quick profile writing into `<tmp_path>/run`; overrides win."""
    return lambda *overrides: quick_config(*overrides, output_dir=tmp_path / "run")
