"""The one-step-off sampler in a process of its own (`loorl.rollout.engines.sampler_process`): where it runs
(`rollout.devices`), that it samples what the engine would sample in this process from the same
weights and seed, that new weights reach it, and that its failures are errors, not hangs."""

from __future__ import annotations

import pytest
import torch

from loorl.build import build_module, build_task
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.models.load import load_tokenizer
from loorl.models.sources import resolve_model_path
from loorl.parallel.launch import cpu_set
from loorl.rollout.engines.factory import build_engine
from loorl.rollout.engines.sampler_process import Placement, parse_cores, sampler_placement
from loorl.rollout.engines.wrappers.process_engine import ProcessEngine

TWO = {0, 1}


# ---- where it runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "devices, max_staleness, cuda, cpus, expected",
    [
        ("auto", 0, False, TWO, None),  # synchronous: sampled between steps, in the training process
        ("trainer", 1, False, TWO, None),  # one step off, not overlapped
        ("auto", 1, False, TWO, Placement("cpu", (1,), None, (0,))),  # the upper half of the cores
        ("auto", 1, False, {0, 1, 2, 3}, Placement("cpu", (2, 3), None, (0, 1))),
        ("auto", 1, False, {5}, None),  # one core: nothing to overlap on
        ("auto", 1, True, TWO, Placement("cuda", gpu=None)),  # the trainer's GPU (current at start), shared
        ("cpu:0", 1, False, TWO, Placement("cpu", (0,), None, (1,))),
        ("cpu:1-2", 1, False, {0, 1, 2}, Placement("cpu", (1, 2), None, (0,))),
        ("cpu:1", 1, True, TWO, Placement("cpu", (1,))),  # a GPU trainer keeps its cores
        ("cuda:1", 1, True, TWO, Placement("cuda", gpu=1)),
    ],
)
def test_rollout_devices_place_the_sampler(devices, max_staleness, cuda, cpus, expected):
    assert sampler_placement(devices, max_staleness=max_staleness, cuda=cuda, cpus=cpus) == expected


def test_data_parallel_ranks_each_place_their_own_sampler():
    """strategy=ddp: on CPU the ranks share the cores out already (each samples in its own process, not
    overlapped); on CUDA each rank's sampler shares that rank's GPU (resolved when it starts)."""
    several = dict(max_staleness=1, cpus=TWO, several_processes=True)
    assert sampler_placement("auto", cuda=False, **several) is None
    assert sampler_placement("auto", cuda=True, **several) == Placement("cuda", gpu=None)
    assert sampler_placement("trainer", cuda=True, **several) is None


@pytest.mark.parametrize(
    "devices, max_staleness, message",
    [
        ("cpu:1", 0, "rollout.devices=cpu:1 places the one-step-off sampler .* set rollout.max_staleness=1"),
        ("cpu:0,1", 1, "takes every core this process may use, leaving none for training"),
        ("cpu:7", 1, "names core 7, which this process may not use \\(its cores: 0,1\\)"),
        ("cpu:x", 1, "rollout.devices=cpu:x names no cores: give them as cpu:1"),
        ("gpu:1", 1, "rollout.devices=gpu:1 is not one of: auto | trainer | cpu:"),
    ],
)
def test_rollout_devices_that_cannot_run_are_one_line(devices, max_staleness, message):
    with pytest.raises(ConfigError, match=message) as err:
        sampler_placement(devices, max_staleness=max_staleness, cuda=False, cpus=TWO)
    assert "\n" not in str(err.value)


def test_cores_are_parsed_as_taskset_lists():
    assert parse_cores("3") == (3,)
    assert parse_cores("0,2-4") == (0, 2, 3, 4)


def test_rollout_devices_compose_and_are_checked_before_any_model_loads(quick_cfg):
    s = check_config(quick_cfg("rollout.max_staleness=1", "rollout.devices=trainer"))
    assert s.rollout.devices == "trainer"
    assert check_config(quick_cfg()).rollout.devices == "auto"  # the default
    with pytest.raises(ConfigError, match="rollout.devices=cpu:0 places the one-step-off sampler"):
        check_config(quick_cfg("rollout.devices=cpu:0"))


# ---- what it samples ----------------------------------------------------------------------------------
@pytest.fixture
def policy_and_engines(quick_cfg):
    """The quick run's policy, its HF engine in this process, and the same engine in a process on the last
    core (the trainer's cores left as they are: this is the test's process)."""
    s = check_config(quick_cfg("rollout=hf"))
    path = resolve_model_path(s.model, s.task, build_task(s))
    module = build_module(s, path)
    module.configure_model()

    def built():
        tokenizer = load_tokenizer(path)
        return build_engine(s.rollout, tokenizer, model_path=path, seed=0, cuda=False, choice=s.engine)

    engine = built()
    remote = ProcessEngine(built(), Placement("cpu", (max(cpu_set()),)))
    yield module.policy, engine, remote
    remote.close()


def _tokens(groups) -> list[list[list[int]]]:
    return [[c.token_ids for c in g] for g in groups]


def test_the_sampler_process_samples_what_this_process_would(policy_and_engines):
    policy, engine, remote = policy_and_engines
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the process has one core: the same thread count, the same kernels
    sampled = []
    try:
        for version in (0, 1):
            if version:  # an update: the process must sample with the new weights, not its first copy
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.05 * torch.randn_like(p))
            engine.sync(policy, version=version)
            remote.sync(policy, version=version)
            remote.submit(prompts, n=4, seed=11)
            here = engine.generate(prompts, n=4, seed=11)  # meanwhile, in this process
            there, seconds = remote.receive()
            assert seconds > 0 and remote.wait_seconds >= 0
            assert _tokens(there) == _tokens(here)
            # the log-probs to float32 rounding: this test's process carries global torch settings that
            # earlier tests leave behind, which a fresh process does not (whole runs are compared to the
            # last digit in tests/test_async.py)
            for g_there, g_here in zip(there, here):
                for a, b in zip(g_there, g_here):
                    torch.testing.assert_close(
                        torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5
                    )
            sampled.append(_tokens(there))
    finally:
        torch.set_num_threads(threads)
    assert sampled[0] != sampled[1]  # the same seed, new weights: other samples


def test_a_failing_or_dead_sampler_process_is_an_error_not_a_hang(policy_and_engines):
    policy, _, remote = policy_and_engines
    remote.sync(policy, version=0)
    remote.submit([[10**6]], n=2, seed=0)  # a token id outside the vocabulary: the process's forward fails
    with pytest.raises(RuntimeError, match="the sampler process failed:\n(.|\n)*IndexError"):
        remote.receive()
    remote.submit([[5, 6]], n=2, seed=0)  # it still serves after a failed request
    assert len(remote.receive()[0][0]) == 2
    remote.process.kill()
    remote.process.join()
    with pytest.raises(RuntimeError, match="the sampler process died \\(exit code -9\\)"):
        remote.submit([[5, 6]], n=2, seed=0)  # the pipe is broken: the request cannot be sent
        remote.receive()
