"""The vLLM engine's sync bookkeeping around sleep mode.

Sleep mode needs CUDA, so the engine here talks to a stand-in that records the calls vLLM's `LLM`
would receive (`wake_up`, `sleep`, `collective_rpc("reload_weights")`, `reset_prefix_cache`); the
weight copy itself runs against real vLLM in tests/test_vllm.py.
"""

from __future__ import annotations

import pytest
import torch

from loorl.rollout.engines.vllm_engine import VLLMEngine
from loorl.types import SamplingConfig


class RecordingLLM:
    def __init__(self):
        self.calls: list[str] = []

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up:{','.join(tags or [])}")

    def sleep(self, level):
        self.calls.append(f"sleep:{level}")

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def _engine(sleep_level):
    engine = VLLMEngine(
        SamplingConfig(max_new_tokens=4), eos_token_ids=[1], pad_token_id=0, model_path="unused",
        sleep_level=sleep_level,
    )  # fmt: skip
    engine.llm = RecordingLLM()
    return engine


def _reloads(engine) -> int:
    return engine.llm.calls.count("reload_weights")


POLICY = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("sleep_level", [None, 1, 2])
def test_same_version_without_a_discarding_sleep_is_not_copied_again(sleep_level):
    engine = _engine(sleep_level)
    engine.sync(POLICY, version=0)
    engine.sync(POLICY, version=0)  # e.g. validation right after the rollout: nothing changed
    assert _reloads(engine) == 1
    engine.sync(POLICY, version=1)
    assert _reloads(engine) == 2


def test_level_one_sleep_keeps_the_weights():
    engine = _engine(1)
    engine.sync(POLICY, version=0)
    engine.sleep()
    engine.sync(POLICY, version=0)  # offloaded to CPU memory and restored on wake-up
    assert _reloads(engine) == 1
    assert engine.llm.calls == [
        "reload_weights", "reset_prefix_cache", "sleep:1", "wake_up:weights", "wake_up:kv_cache",
    ]  # fmt: skip


def test_level_two_sleep_always_reloads_on_the_next_sync():
    engine = _engine(2)
    engine.sync(POLICY, version=0)
    for _ in range(3):  # second validation batch, first rollout after validation, ...
        engine.sleep()
        engine.sync(POLICY, version=0)  # the same version, but the weights were discarded
    assert _reloads(engine) == 4
    # after every sleep: weights woken, copied, prefix cache reset, then the KV cache woken
    assert engine.llm.calls[-5:] == [
        "sleep:2", "wake_up:weights", "reload_weights", "reset_prefix_cache", "wake_up:kv_cache",
    ]  # fmt: skip
