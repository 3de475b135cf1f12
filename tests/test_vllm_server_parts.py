"""The vLLM-server engine's parts that need no server (`rollout=vllm_server`): the launched servers'
command line, prompts spread over servers, weight shards, the adapters' folder, and what one sample's
answer says. The runs against a real server are tests/test_vllm_server.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def test_engines_and_launched_servers_run_eager_on_cpu_unless_told():
    """`enforce_eager: null`: no compiled graphs on CPU (vLLM's compile there costs ~25 s of start-up),
    CUDA graphs on GPU; a value given is kept."""
    from loorl.rollout.engines.vllm_engine import eager_unless_cuda
    from loorl.rollout.engines.vllm_server import launch_command

    assert eager_unless_cuda(None, cuda=False) and not eager_unless_cuda(None, cuda=True)
    assert not eager_unless_cuda(False, cuda=False) and eager_unless_cuda(True, cuda=True)
    where = {"model_path": "m", "port": 8000, "dtype": "float32", "max_model_len": 64, "max_staleness": 0}
    on_cpu = launch_command(server_settings_of({}), cuda=False, lora_rank=None, **where)
    assert "--enforce-eager" in on_cpu and "--kv-cache-memory-bytes" in on_cpu
    assert "--enforce-eager" not in launch_command(server_settings_of({}), cuda=True, lora_rank=None, **where)
    told = server_settings_of({"enforce_eager": False})
    assert "--enforce-eager" not in launch_command(told, cuda=False, lora_rank=None, **where)


def test_prompts_spread_over_servers_in_whole_blocks_and_shards_hold_a_byte_limit():
    from loorl.rollout.engines.server_requests import spread
    from loorl.rollout.engines.vllm_server import max_loras, transfer_backend
    from loorl.rollout.engines.weight_transfer import shards

    assert spread(5, 2) == [0, 0, 0, 1, 1] and spread(2, 3) == [0, 1] and spread(4, 1) == [0] * 4
    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([4, 4, 10, 1])]  # float32: 16, 16, 40, 4 bytes
    assert [list(s) for s in shards(tensors, 32)] == [["w0", "w1"], ["w2"], ["w3"]]  # w2 alone: too big
    assert (
        transfer_backend("auto", cuda=False) == "loorl_files"
        and transfer_backend("auto", cuda=True) == "nccl"
    )
    assert (
        max_loras(server_settings_of({}), 2) == 3 and max_loras(server_settings_of({"max_loras": 8}), 2) == 8
    )


def server_settings_of(block: dict):
    from loorl.rollout.engines.vllm_server import ServerSettings

    return ServerSettings.from_cfg(block, "rollout.server")


def test_an_engine_never_closed_leaves_no_adapter_folder_behind(tmp_path):
    """The LoRA adapters' folder (`rollout.server.transfer_folder`: /dev/shm) goes when the process
    exits, also for an engine that was never closed (one alive at exit, one dropped before)."""
    script = f"""
import gc
from loorl.rollout.engines.vllm_server import ServerEngine, ServerSettings
from loorl.types import SamplingConfig

def engine():
    return ServerEngine(SamplingConfig(max_new_tokens=4), eos_token_ids=[0], pad_token_id=0,
                        settings=ServerSettings(transfer_folder={str(tmp_path)!r}), model_path="unused",
                        tokenizer=None)

kept, dropped = engine(), engine()
print(kept.adapters.folder(), dropped.adapters.folder())
del dropped
gc.collect()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made = done.stdout.split()
    assert len(made) == 2 and all(Path(m).parent == tmp_path and "loorl-adapters-" in m for m in made)
    assert list(tmp_path.iterdir()) == []


def test_a_sample_counts_as_drawn_by_the_oldest_version_among_its_tokens():
    """vLLM's answer for one sample: ids, per-token log-probs and weight-version spans over its tokens."""
    from loorl.rollout.engines.server_requests import completion_of
    from loorl.types import Completion

    choice = {
        "token_ids": [5, 6, 1],
        "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}, {"logprob": -0.125}]},
        "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
    }
    cut = lambda t, lp: Completion(t, lp, t[-1] == 1)  # noqa: E731
    sample = completion_of(choice, cut)
    assert (sample.token_ids, sample.logprobs, sample.finished) == ([5, 6, 1], [-0.5, -0.25, -0.125], True)
    assert (sample.version, sample.spans_versions) == (3, True)
    choice["weight_versions"] = [{"version": "default", "start": 0, "end": 3}]  # before any update
    assert completion_of(choice, cut).version is None
    with pytest.raises(RuntimeError, match="3 tokens with 2 log-probs"):
        completion_of(choice | {"logprobs": {"content": [{"logprob": 0.0}] * 2}}, cut)
