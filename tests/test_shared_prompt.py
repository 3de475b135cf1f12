"""`rl.share_prompt`: each group's prompt runs once (training forward, log-prob passes, the HF
engine's prefill). Checked on the real tiny Qwen2 model against every row running its whole
sequence: the same log-probs, the same gradients, the same samples for a seed."""

from __future__ import annotations

import pytest
import torch

from fixtures import tiny_model_and_prompts
from loorl.algo.logprobs import completion_logits, completion_logprobs, token_logprobs
from loorl.rollout.batch import assemble
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.types import Completion, SamplingConfig


@pytest.fixture(scope="module")
def tiny(quick_config):
    return tiny_model_and_prompts(quick_config())


def _engine(tok, share: bool, **sampling) -> HFEngine:
    return HFEngine(
        SamplingConfig(**{"max_new_tokens": 5, **sampling}),
        share_prompt=share,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )


def _samples(tiny, share: bool, **kw):
    tok, model, ids = tiny
    engine = _engine(tok, share, **kw)
    engine.sync(model)
    return engine.generate(ids, n=4, seed=7)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 5}])
def test_a_shared_prefill_draws_the_samples_of_a_plain_one(tiny, sampling):
    plain, shared = _samples(tiny, False, **sampling), _samples(tiny, True, **sampling)
    for p_group, s_group in zip(plain, shared):
        for p, s in zip(p_group, s_group):
            assert p.token_ids == s.token_ids and p.finished == s.finished
            assert torch.allclose(torch.tensor(p.logprobs), torch.tensor(s.logprobs), atol=1e-5)


def test_generate_calls_hold_whole_groups(tiny):
    """A call budget of 6 rows with n=4 takes one group per call (not 6 rows splitting a group)."""
    tok, model, ids = tiny
    engine = _engine(tok, True)
    engine.batch_size = 6
    engine.sync(model)
    groups = engine.generate(ids, n=4, seed=7)
    assert [len(g) for g in groups] == [4] * len(ids)
    engine_plain = _engine(tok, False)
    engine_plain.batch_size = 4  # the same calls, so the same random draws
    engine_plain.sync(model)
    assert [[c.token_ids for c in g] for g in groups] == [
        [c.token_ids for c in g] for g in engine_plain.generate(ids, n=4, seed=7)
    ]


def _batch(tiny):
    tok, _, ids = tiny
    groups = _samples(tiny, True)
    rewards = torch.zeros(len(ids), 4)
    return assemble(ids, groups, pad_token_id=tok.pad_token_id, rewards=rewards)


def _loss_and_grads(model, batch, share: bool):
    model.zero_grad(set_to_none=True)
    logits = completion_logits(model, batch, share_prompt=share)  # [N, C, V]
    logp = token_logprobs(logits, batch.completion_ids, temperature=0.7)  # [N, C]
    weights = torch.linspace(-1, 1, logp.shape[0]).unsqueeze(-1)  # [N, 1] distinct per row
    loss = -(logp * weights * batch.completion_mask).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach(), grads


def test_the_shared_prompt_forward_gives_the_full_forwards_logprobs_and_gradients(tiny):
    _, model, _ = tiny
    model.train()
    batch = _batch(tiny)
    mask = batch.completion_mask.bool()  # [N, C]
    full_logp, full_grads = _loss_and_grads(model, batch, share=False)
    shared_logp, shared_grads = _loss_and_grads(model, batch, share=True)
    assert (full_logp[mask] - shared_logp[mask]).abs().max() < 1e-5
    for name, g in full_grads.items():
        assert g.abs().max() > 0, name  # every parameter gets a gradient (the prompt's too)
        # float32 rounding differs (sums in another order): relative to the gradient's own scale
        assert (shared_grads[name] - g).abs().max() < 1e-5 * g.abs().max(), name
    model.zero_grad(set_to_none=True)


def test_no_grad_logprob_passes_share_the_prompt_too(tiny):
    _, model, _ = tiny
    batch = _batch(tiny)
    mask = batch.completion_mask.bool()
    sampling = SamplingConfig(max_new_tokens=5)
    with torch.no_grad():
        full = completion_logprobs(model, batch, sampling=sampling, groups_per_pass=2)
        shared = completion_logprobs(model, batch, sampling=sampling, groups_per_pass=2, share_prompt=True)
    assert (full[mask] - shared[mask]).abs().max() < 1e-5
    assert (shared[mask] - batch.sampler_logprobs[mask]).abs().max() < 1e-4  # the sampler's own


def test_single_token_completions_and_gradient_checkpointing_fall_back_or_work(tiny):
    """C = 1 needs only the prompt pass; under gradient checkpointing (no cache) every row runs whole."""
    tok, model, ids = tiny
    model.train()
    one = [[Completion(token_ids=[tok.eos_token_id], logprobs=[0.0], finished=True)] * 2 for _ in range(3)]
    batch = assemble(ids[:3], one, pad_token_id=tok.pad_token_id, rewards=torch.zeros(3, 2))
    assert torch.allclose(
        completion_logits(model, batch, share_prompt=True), completion_logits(model, batch), atol=1e-5
    )
    model.gradient_checkpointing_enable()
    try:
        batch = _batch(tiny)
        full_logp, _ = _loss_and_grads(model, batch, share=False)
        shared_logp, _ = _loss_and_grads(model, batch, share=True)
        assert torch.allclose(full_logp, shared_logp, atol=1e-5)
    finally:
        model.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)


def test_bf16_generation_casts_weights_once_per_call_and_sees_updated_weights(tiny):
    """Under an outer autocast with its cache off (Lightning's bf16-mixed), the engine samples in bf16
    with cached weight casts, and a weight change between two calls inside that same outer autocast
    is seen by the second call (the cache does not outlive a call)."""
    tok, model, ids = tiny
    engine = _engine(tok, True)
    engine.sync(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        before = engine.generate(ids, n=2, greedy=True)
        saved = model.lm_head.weight.detach().clone()
        with torch.no_grad():
            model.lm_head.weight.zero_()  # every logit 0: greedy takes id 0 at every step
        try:
            after = engine.generate(ids, n=2, greedy=True)
        finally:
            with torch.no_grad():
                model.lm_head.weight.copy_(saved)
    assert all(c.token_ids != [0] * 5 for g in before for c in g)
    assert all(c.token_ids == [0] * 5 for g in after for c in g)
