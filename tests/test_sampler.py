"""The sampler is the distribution the trainer scores: no model generation defaults leak in,
top-k/top-p truncation is scored by the trainer too, and every EOS id ends a completion."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hydra.utils import instantiate

from fixtures import HOSTILE_GENERATION_CONFIG, copy_model, needs_vllm
from loorl.algo.logprobs import filter_logits, token_entropy, token_logprobs
from loorl.cli.train import train
from loorl.models.load import load_causal_lm, load_tokenizer
from loorl.models.tiny import ensure_tiny_model
from loorl.rollout.engines.base import eos_token_ids
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.types import SamplingConfig


@pytest.fixture(scope="module")
def tiny_dir(quick_config):
    cfg = quick_config()
    return ensure_tiny_model(cfg.model, cfg.task, instantiate(cfg.task))


@pytest.fixture(scope="module")
def hostile_dir(tiny_dir, tmp_path_factory):
    return copy_model(
        tiny_dir, tmp_path_factory.mktemp("hostile") / "model", generation=HOSTILE_GENERATION_CONFIG
    )


def _history(quick_config, tmp_path, *overrides):
    cfg = quick_config("rl.steps=3", "val_every=3", *overrides, output_dir=tmp_path)
    train(cfg)
    return json.loads((tmp_path / "metrics.json").read_text())["history"]


# ---- no generation defaults from the model's files ---------------------------------------------
def test_model_generation_config_does_not_change_the_hf_sampler(quick_config, hostile_dir, tmp_path):
    history = _history(quick_config, tmp_path, f"model.name_or_path={hostile_dir}", "rollout=hf")
    worst = max(v for _, v in history["train/sampler_logratio_max"])
    assert worst < 1e-4, worst  # with the model's repetition penalty leaking in it was ~0.1


# vLLM's sampler on the same model: tests/test_vllm.py's training run (one vLLM run for both checks)


# ---- a temperature schedule: each rollout scored at the temperature that drew it ----------------
def test_a_temperature_schedule_samples_and_scores_each_step_at_its_temperature(quick_config, tmp_path):
    history = _history(quick_config, tmp_path, "rollout=hf", "rollout.temperature=1.0",
                       "rollout.temperature_schedule={2: 0.5}")  # fmt: skip
    assert [v for _, v in history["rollout/temperature"]] == [1.0, 1.0, 0.5]
    worst = max(v for _, v in history["train/sampler_logratio_max"])
    assert worst < 1e-4, worst  # scored at 1.0, step 2's samples drawn at 0.5 would differ by ~1


def test_the_schedule_holds_or_interpolates_between_its_anchors(quick_config):
    from loorl.config import check_config

    steps = (0, 10, 19, 20, 30, 40, 100)
    schedule = ("rollout.temperature=0.7", "rollout.temperature_schedule={20: 0.9, 40: 1.1}")
    held = check_config(quick_config(*schedule)).rollout
    assert [held.temperature_at(s) for s in steps] == [0.7, 0.7, 0.7, 0.9, 0.9, 1.1, 1.1]
    linear = check_config(quick_config(*schedule, "rollout.temperature_ramp=linear")).rollout
    assert [linear.temperature_at(s) for s in steps] == pytest.approx([0.7, 0.8, 0.89, 0.9, 1.0, 1.1, 1.1])
    assert check_config(quick_config()).rollout.temperature_schedule is None  # off by default


def test_greedy_is_deterministic_argmax_despite_the_model_config(hostile_dir):
    tok = load_tokenizer(str(hostile_dir))
    model = load_causal_lm(str(hostile_dir), dtype="float32")
    engine = HFEngine(
        SamplingConfig(max_new_tokens=6), eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    engine.sync(model)
    prompts = [tok(f"{a}+{b}=", add_special_tokens=False).input_ids for a, b in [(3, 4), (12, 9), (7, 21)]]
    runs = [[g[0].token_ids for g in engine.generate(prompts, n=1, greedy=True)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    for prompt, tokens in zip(prompts, runs[0]):  # each token is the argmax given the prefix
        ids = torch.tensor([prompt + tokens])  # [1, P + C]
        with torch.no_grad():
            argmax = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].argmax(-1)  # [C]
        assert argmax.tolist() == tokens
    assert model.generation_config.repetition_penalty == 1.5  # the model's own config is left as it was


# ---- top-k / top-p: the trainer scores the truncated distribution ------------------------------
def _hf_reference_truncation(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' own warpers, applied to [n, V] rows: the sampler the trainer must match."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    out = scaled
    if top_k > 0:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1.0:
        out = TopPLogitsWarper(top_p)(None, out)
    return out


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.5), (0, 0.9), (7, 0.8), (1, 1.0), (50, 1.0)])
def test_truncation_matches_transformers_warpers(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 10 + int(top_p * 10))
    logits = torch.randn(3, 5, 40, generator=g) * 2  # [n, T, V]
    logits[0, 0, :4] = 5.0  # ties at the top
    got = filter_logits(logits, top_k=top_k, top_p=top_p)  # [n, T, V]
    want = _hf_reference_truncation(logits.reshape(-1, 40), top_k, top_p).view_as(logits)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_truncated_logprobs_value_gradient_and_kept_sampled_token():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 12, generator=g, dtype=torch.float64) * 2).requires_grad_()  # [n, T, V]
    kept = logits.detach().topk(4, dim=-1).indices  # [n, T, 4]
    tokens = kept[..., 1].clone()  # [n, T] a token inside the top 4
    tokens[0, 0] = logits[0, 0].detach().argmin()  # ... and one outside it: it must stay scorable
    got = token_logprobs(logits, tokens, temperature=0.7, top_k=4)  # [n, T]
    # by hand: log-softmax over the kept set (top 4, plus the sampled token)
    want = torch.empty_like(got)
    for i in range(2):
        for t in range(3):
            support = set(kept[i, t].tolist()) | {int(tokens[i, t])}
            sub = torch.stack([logits[i, t, v] / 0.7 for v in sorted(support)])
            want[i, t] = logits[i, t, tokens[i, t]] / 0.7 - torch.logsumexp(sub, 0)
    torch.testing.assert_close(got, want)
    w = torch.randn(2, 3, generator=g, dtype=torch.float64)
    (grad_got,) = torch.autograd.grad((got * w).sum(), logits)
    (grad_want,) = torch.autograd.grad((want * w).sum(), logits)
    torch.testing.assert_close(grad_got, grad_want)
    assert torch.isfinite(got).all()
    # entropy of the truncated distribution: log 4 for four equal kept logits
    flat = torch.tensor([[[3.0, 3.0, 3.0, 3.0, 0.0, -1.0]]])  # [1, 1, 6]
    assert float(token_entropy(flat, top_k=4)) == pytest.approx(math.log(4))
    # top_p=0.5: the four top entries have 0.246 each; dropping from the bottom while the dropped
    # mass stays <= 0.5 removes both small ones and one top entry, leaving three equal ones
    assert float(token_entropy(flat, top_p=0.5)) == pytest.approx(math.log(3))


# How far the trainer's truncated log-probs may be from the sampler's. On the CPU (float32) the cached
# decode and the full forward agree to float rounding. On CUDA the kernels differ per shape in the last
# bits, and a top-k cut-off between two near-equal logits then gives a sampled token another support (one
# such token moves a step's mean by about 1e-3): a looser bound there, still far below the bug's -0.67.
TRUNCATED_GAP = 1e-2 if torch.cuda.is_available() else 1e-4


@pytest.mark.parametrize("override", ["rollout.top_k=5", "rollout.top_p=0.5"])
def test_truncated_sampling_trains_on_the_sampler_distribution(quick_config, tmp_path, override):
    history = _history(quick_config, tmp_path, "rollout=hf", override)
    worst = max(abs(v) for _, v in history["train/sampler_logratio_mean"])
    assert worst < TRUNCATED_GAP, worst  # was -1.86 (top_k=5) and -0.67 (top_p=0.5) scoring the full softmax


# ---- every EOS id ends a completion ------------------------------------------------------------
@pytest.fixture(scope="module")
def two_eos_dir(tiny_dir, tmp_path_factory):
    tok = load_tokenizer(str(tiny_dir))
    five = tok.convert_tokens_to_ids("5")
    ids = [tok.eos_token_id, five]  # "5" plays a second EOS, like Qwen's <|endoftext|>
    path = copy_model(
        tiny_dir,
        tmp_path_factory.mktemp("two_eos") / "model",
        generation={"eos_token_id": ids},
        config={"eos_token_id": ids},
    )
    return path, ids


def _check_every_eos_ends(groups, ids, *, second_must_occur=True):
    stopped_at_second = 0
    for group in groups:
        for c in group:
            assert not set(c.token_ids[:-1]) & set(ids)  # nothing after the first EOS of any kind
            assert c.finished == (c.token_ids[-1] in ids)
            stopped_at_second += c.token_ids[-1] == ids[1]
            assert c.text_ids == (c.token_ids[:-1] if c.finished else c.token_ids)
    assert stopped_at_second > 0 or not second_must_occur  # the second id really ended completions


def _engine_for(cfg, path):
    from loorl.config import engine_choice, load_settings
    from loorl.rollout.engines.factory import build_engine

    tok = load_tokenizer(str(path))
    s = load_settings(cfg)
    engine = build_engine(s.rollout, tok, model_path=str(path), model_dtype="float32", seed=0,
                          choice=engine_choice(s))  # fmt: skip
    return engine, tok


def _prompts(tok):
    return [tok(f"{a}+{b}=", add_special_tokens=False).input_ids for a in range(0, 30, 3) for b in (2, 5, 13)]


def test_eos_ids_come_from_tokenizer_config_and_generation_config(two_eos_dir):
    path, ids = two_eos_dir
    assert eos_token_ids(str(path), load_tokenizer(str(path))) == ids


def test_hf_engine_stops_at_every_eos_id(quick_config, two_eos_dir):
    path, ids = two_eos_dir
    engine, tok = _engine_for(quick_config("rollout=hf"), path)
    assert engine.eos_token_ids == ids
    engine.sync(load_causal_lm(str(path), dtype="float32"))
    torch.manual_seed(0)
    _check_every_eos_ends(engine.generate(_prompts(tok), n=4), ids)
    _check_every_eos_ends(engine.generate(_prompts(tok), n=1, greedy=True), ids, second_must_occur=False)


@pytest.mark.vllm
@needs_vllm
def test_vllm_engine_stops_at_every_eos_id(quick_config, two_eos_dir):
    path, ids = two_eos_dir
    engine, tok = _engine_for(quick_config("rollout=vllm"), path)
    engine.sync(load_causal_lm(str(path), dtype="float32"), version=0)
    _check_every_eos_ends(engine.generate(_prompts(tok), n=4), ids)


def test_inverse_cdf_sampling_draws_the_distribution_it_is_given():
    """The HF engine's sampler (one uniform per row, `decoding.sample_tokens`) against the exact
    probabilities: frequencies within sampling error, never a truncated (-inf) entry, a point mass
    always, and the same draws for the same seed."""
    from loorl.rollout.engines.decoding import sample_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 2  # [3, 50]
    logits[:, 10:20] = -math.inf  # what top-k / top-p truncation leaves
    logits[2] = -math.inf
    logits[2, 33] = 0.0  # a point mass
    logp = logits.log_softmax(-1)  # [3, 50]
    draws = 20_000
    gen = torch.Generator().manual_seed(1)
    samples = torch.stack([sample_tokens(logp, gen) for _ in range(draws)])  # [draws, 3]
    for row in range(3):
        freq = torch.bincount(samples[:, row], minlength=50).float() / draws  # [50]
        p = logp[row].exp()
        assert freq[10:20].sum() == 0
        # 4 standard errors of a frequency at each p
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / draws).sqrt() + 1e-9).all(), (freq - p).abs().max()
    assert (samples[:, 2] == 33).all()
    again = torch.Generator().manual_seed(1)
    assert torch.equal(torch.stack([sample_tokens(logp, again) for _ in range(50)]), samples[:50])
