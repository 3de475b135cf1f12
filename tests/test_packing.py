"""Packed token-budget micro-batches (`rl.microbatch_tokens`, `loorl.algo.packing`) against the
padded micro-batches they replace, on the real tiny Qwen2 model: the same log-probs, loss and
gradient for every aggregation mode, with the shared prompt on and off."""

from __future__ import annotations

import pytest
import torch

from fixtures import tiny_parts
from loorl.algo.logprobs import completion_logits, completion_logprobs, microbatch_rows, token_logprobs
from loorl.algo.objectives import AGGREGATIONS
from loorl.algo.packing import pack, packed_attention_mask, plan_microbatches, unit_costs
from loorl.build import build_module
from loorl.rollout.batch import assemble
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.types import SamplingConfig


# ---- the plan -----------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 7, 10, 25, 1000])
def test_every_unit_lands_once_within_the_budget(budget):
    costs = [5, 3, 9, 2, 7, 1, 4, 12]
    plans = plan_microbatches(costs, budget)
    assert sorted(u for plan in plans for u in plan) == list(range(len(costs)))
    for plan in plans:
        load = sum(costs[u] for u in plan)
        assert load <= budget or len(plan) == 1  # a unit over the budget runs alone
    assert plans == plan_microbatches(costs, budget)  # deterministic
    if budget == 10:  # first-fit decreasing by hand: 12 | 9+1 | 7+3 | 5+4 | 2
        assert plans == [[7], [2, 5], [1, 4], [0, 6], [3]]


# ---- the packed forward -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(quick_config):
    return tiny_parts(quick_config())


def _batch(tiny, *, num_prompts=6, k=4, seed=0):
    """A rollout of the tiny model: prompts of different lengths, completions of different lengths."""
    cfg, task, _, tok, model = tiny
    engine = HFEngine(
        SamplingConfig(max_new_tokens=6), eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    engine.sync(model)
    ids = [tok(p.text, add_special_tokens=False).input_ids for p in task.eval_prompts()[:num_prompts]]
    groups = engine.generate(ids, n=k, seed=seed)
    batch = assemble(ids, groups, pad_token_id=tok.pad_token_id, rewards=torch.zeros(num_prompts, k))
    lengths = batch.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1 and len({len(i) for i in ids}) > 1  # padding on both sides
    return batch


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_packed_pass_scores_what_the_padded_pass_scores(tiny, share, implementation):
    _, _, _, _, model = tiny
    batch = _batch(tiny)
    mask = batch.completion_mask.bool()
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, top_k=5)
    model.config._attn_implementation = implementation
    try:
        with torch.no_grad():
            padded = token_logprobs(
                completion_logits(model, batch), batch.completion_ids, **sampling.score_args
            )
            for budget in (10, 64, 10_000):  # one row per micro-batch (over budget), several, all at once
                packed = completion_logprobs(model, batch, sampling=sampling, share_prompt=share,
                                             microbatch_tokens=budget)  # fmt: skip
                assert (packed[mask] - padded[mask]).abs().max() < 1e-5, budget
    finally:
        model.config._attn_implementation = "sdpa"


def test_packing_drops_the_padding_and_shares_the_prompt_once_per_group(tiny):
    batch = _batch(tiny)
    real = int(batch.attention_mask.sum())
    assert pack(batch, share_prompt=False).input_ids.shape[1] == real < batch.attention_mask.numel()
    k, p_len = batch.samples_per_prompt, batch.prompt_len
    prompts = int(batch.attention_mask[:, :p_len].sum())
    shared = pack(batch, share_prompt=True)
    assert shared.input_ids.shape[1] == real - prompts + prompts // k
    assert sum(unit_costs(batch, share_prompt=True)) == shared.input_ids.shape[1]
    allowed = packed_attention_mask(shared, implementation="sdpa", dtype=torch.float32)[0, 0]  # [T, T]
    rows = shared.sequence
    # a completion token never sees another row's completion, always its own group's prompt
    completion = rows >= 0
    cross = allowed & completion[:, None] & completion[None, :] & (rows[:, None] != rows[None, :])
    assert not cross.any()
    assert packed_attention_mask(shared, implementation="flash_attention_2", dtype=torch.float32) is None


def test_microbatches_hold_the_budget_and_whole_groups_when_the_prompt_is_shared(tiny):
    batch = _batch(tiny)
    real = batch.attention_mask.sum(-1)  # [N]
    for share in (False, True):
        pieces = microbatch_rows(batch, 40, share_prompt=share)
        assert sorted(torch.cat(pieces).tolist()) == list(range(batch.input_ids.shape[0]))
        for rows in pieces:
            sub = batch.select_rows(rows)
            assert sum(unit_costs(sub, share_prompt=share)) <= 40 or len(rows) <= batch.samples_per_prompt
            if share:
                assert sub.samples_per_prompt == batch.samples_per_prompt  # whole groups, in order
        if not share:
            assert (real[pieces[0]].sum() <= 40) or len(pieces[0]) == 1


# ---- the packed training step -------------------------------------------------------------------
def _step(cfg, path, batch, overrides):
    module = build_module(cfg(*overrides), path)
    module.configure_model()
    stats = module.accumulate_gradients(batch, lambda loss: loss.backward())
    grads = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    return stats, grads


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("share", [False, True])
def test_a_packed_step_equals_the_padded_step(quick_config, tiny, agg, share):
    """Same loss and gradient (1e-5 of the gradient's scale) whatever the token budget; the
    skipped groups (all advantages 0) are left out of both alike."""
    _, _, path, _, _ = tiny
    batch = _batch(tiny)
    advantages = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    advantages[2] = 0.0  # a group without signal
    batch.advantages = advantages.reshape(-1)
    base = (f"loss.agg={agg}", f"rl.share_prompt={share}", "rollout.temperature=0.8", "rollout.top_k=7")
    padded_stats, padded = _step(quick_config, path, batch, (*base, "rl.prompts_per_microbatch=2"))
    scale = padded.abs().max()
    assert scale > 0
    for budget, chunk in ((48, 7), (400, 512)):  # 7: the output layer in ragged chunks of 7 positions
        overrides = (*base, f"rl.microbatch_tokens={budget}", f"rl.logprob_chunk_tokens={chunk}")
        stats, grads = _step(quick_config, path, batch, overrides)
        grad_diff = float((grads - padded).abs().max() / scale)
        loss_diff = abs(stats.loss - padded_stats.loss)
        print(f"{agg} share_prompt={share} budget={budget}: loss {loss_diff:.1e}, gradient {grad_diff:.1e}")
        assert (grads - padded).abs().max() <= 1e-5 * scale, budget
        assert stats.loss == pytest.approx(padded_stats.loss, rel=1e-5, abs=1e-8)
        assert stats.entropy == pytest.approx(padded_stats.entropy, rel=1e-5)
        assert stats.tokens == padded_stats.tokens
