"""The tiny model's warm start: the teacher-forced greedy probe and stopping at a target accuracy."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from loorl.models.load import load_causal_lm, load_tokenizer
from loorl.models.tiny import (
    _tiny_policy,
    build_char_tokenizer,
    ensure_tiny_model,
    greedy_exact,
    sft_batch,
    warm_start,
)
from loorl.settings import TinyModelSettings, WarmStartSettings
from loorl.tasks.arithmetic import ArithmeticTask


def test_greedy_exact_by_hand():
    """Two rows of 4 tokens, answers on positions 2-3: the first row's argmaxes follow its answer, the
    second row's first answer token is not the argmax (greedy decoding would leave the answer there)."""
    ids = torch.tensor([[5, 6, 1, 2], [5, 7, 3, 4]])  # [B, L]
    target_mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.float)
    logits = torch.zeros(2, 4, 8)  # [B, L, V]; position t predicts token t+1
    logits[0, 0, 0] = 9  # a wrong argmax at a prompt position does not matter
    logits[0, 1, 1], logits[0, 2, 2] = 9, 9  # the answer 1, 2 followed
    logits[1, 1, 0], logits[1, 2, 4] = 9, 9  # 0 instead of 3, then 4
    assert greedy_exact(logits, ids, target_mask).tolist() == [True, False]


@pytest.fixture(scope="module")
def quick_model(quick_config):
    cfg = quick_config()
    task = instantiate(cfg.task)
    path = str(ensure_tiny_model(cfg.model, cfg.task, task))
    return path, task


def test_greedy_exact_agrees_with_greedy_decoding(quick_model):
    """The probe's verdict per prompt is what real greedy decoding of the same model scores."""
    from transformers import GenerationConfig

    path, task = quick_model
    tokenizer, policy = load_tokenizer(path), load_causal_lm(path, dtype="float32", trainable=False)
    prompts = task.eval_prompts()
    ids, target_mask = sft_batch([(p.text, p.answer) for p in prompts], tokenizer, max_len=512)
    with torch.no_grad():
        probe = greedy_exact(policy(input_ids=ids).logits, ids, target_mask)  # [B]
        enc = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
        config = GenerationConfig(do_sample=False, max_new_tokens=5, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        out = policy.generate(**enc, generation_config=config)
    texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    decoded = [task.is_exact(p, t) for p, t in zip(prompts, texts)]
    assert 0 < sum(decoded) < len(decoded)  # the quick model gets some right and some wrong
    assert probe.tolist() == decoded


def _probe_accuracy(policy, tokenizer, task, ws) -> float:
    """The warm start's own probe (its fixed draw) on `policy`."""
    probe = sft_batch(
        task.sft_examples(ws.probe_size, rng=np.random.default_rng([ws.seed, 1])), tokenizer, 512
    )
    with torch.no_grad():
        return float(greedy_exact(policy(input_ids=probe[0]).logits, *probe).float().mean())


def _warm_started(ws: WarmStartSettings, task):
    tokenizer = build_char_tokenizer()
    torch.manual_seed(ws.seed)
    policy = _tiny_policy(TinyModelSettings(), tokenizer)  # the default architecture
    return policy, tokenizer, warm_start(policy, tokenizer, task, ws)


def test_warm_start_stops_at_the_first_check_that_reaches_the_target():
    """Stopped at step S: the probe is at the target there and below it at step S - check_every, and
    the model is the fixed-step model of S steps (the probe changes nothing it measures)."""
    task = ArithmeticTask()
    # a target of 0.1 is reached in about 95 steps here (0.2 took 215: the test ran the warm start 3 times)
    ws = WarmStartSettings(target_accuracy=0.1, max_steps=1000, check_every=5, probe_size=256, batch_size=32)
    policy, tokenizer, result = _warm_started(ws, task)
    assert 0 < result.steps < ws.max_steps and result.steps % ws.check_every == 0
    assert result.probe_accuracy >= ws.target_accuracy
    assert result.probe_accuracy == _probe_accuracy(policy, tokenizer, task, ws)

    fixed = WarmStartSettings(**{**ws.__dict__, "target_accuracy": None, "max_steps": result.steps})
    same, _, _ = _warm_started(fixed, task)
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), same.state_dict().values()))
    earlier = WarmStartSettings(**{**fixed.__dict__, "max_steps": result.steps - ws.check_every})
    before, tokenizer, _ = _warm_started(earlier, task)
    assert _probe_accuracy(before, tokenizer, task, ws) < ws.target_accuracy


def test_a_warm_start_that_misses_its_target_warns_and_keeps_the_model(quick_config, tmp_path, caplog):
    cfg = quick_config(
        f"model.cache_dir={tmp_path}",
        "model.tiny.warm_start.target_accuracy=0.99",
        "model.tiny.warm_start.max_steps=10",
    )
    with caplog.at_level(logging.WARNING, logger="loorl.models"):
        path = ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task))
    record = json.loads((path / "warm_start.json").read_text())
    assert record["steps"] == 10 and record["probe_accuracy"] < 0.99
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "below target_accuracy=0.99" in caplog.text and "model.tiny.warm_start.max_steps=10" in caplog.text
