"""What ReMax and GDPO read beyond the rewards, through a real rollout of the quick tiny model: ReMax's
greedy completion per prompt (drawn beside the K samples, graded by the same rules, never trained on,
counted) and GDPO's reward parts (each reward function's reward apart, the overlong penalty as a part of
its own), and the advantages the learner computes from them."""

from __future__ import annotations

import pytest
import torch

from fixtures import policy_and_rollouts
from loorl.algo.estimators import AdvantageInput, compute_advantages
from loorl.rewards.library import length_penalty
from loorl.rewards.shaping import overlong_penalty
from loorl.rollout.dynamic_sampling import round_signal


def completion_lengths(batch) -> torch.Tensor:
    return batch.attention_mask[:, batch.prompt_len :].sum(-1)  # [N] tokens incl. EOS


def test_remax_draws_a_greedy_completion_per_prompt_graded_by_the_same_rules(quick_config):
    overrides = ("reward.overlong.buffer=4", "reward.overlong.penalty=0.25", "rollout.max_new_tokens=6")
    cfg, task, tok, module, dm = policy_and_rollouts(quick_config("estimator=remax", *overrides))
    _, _, _, _, plain = policy_and_rollouts(quick_config(*overrides))
    for d in (dm, plain):
        d.engine.sync(module.policy)
    rollout, without = dm.rollout_for_step(step=0), plain.rollout_for_step(step=0)
    batch, k = rollout.batch, cfg.rl.samples_per_prompt
    # the K samples are the ones RLOO's run draws (the greedy call comes after the sampled one)
    assert torch.equal(batch.input_ids, without.batch.input_ids)
    assert torch.equal(batch.rewards, without.batch.rewards) and without.batch.reward_baselines is None
    # the greedy completions, drawn again by hand and graded by the verifier, the overlong rule added
    prompts = dm.sampler.prompts_for_step(0)
    ids = dm.sampler.encode_prompts(prompts)
    greedy = [g[0] for g in dm.engine.generate(ids, n=1, greedy=True)]
    texts = [tok.decode(c.text_ids, skip_special_tokens=True) for c in greedy]
    verdicts = torch.tensor([float(task.grade(p, t)[0]) for p, t in zip(prompts, texts)])  # [B]
    penalty = overlong_penalty(torch.tensor([len(c.token_ids) for c in greedy]), max_len=6, buffer=4,
                               penalty=0.25)  # fmt: skip
    baselines = batch.reward_baselines.view(-1, k)  # [B, K]
    assert (baselines == baselines[:, :1]).all()  # one per group, repeated over its rows
    torch.testing.assert_close(baselines[:, 0], verdicts + penalty)
    assert (penalty < 0).any()  # the rule is exercised on the greedy completions too
    # never trained on: the batch holds the B*K samples only; counted
    assert batch.input_ids.shape[0] == len(prompts) * k
    stats = rollout.stats
    assert stats["rollout/greedy_samples"] == len(prompts) and stats["rollout/greedy_unscorable"] == 0
    assert stats["rollout/greedy_reward_mean"] == pytest.approx(float((verdicts + penalty).mean()))
    assert stats["rollout/greedy_accuracy"] == pytest.approx(float(verdicts.mean()))
    assert stats["rollout/greedy_gen_tokens"] == sum(len(c.token_ids) for c in greedy)
    assert stats["rollout/accuracy"] == without.stats["rollout/accuracy"]  # the samples' alone
    generated = stats["rollout/gen_tokens"] + stats["rollout/greedy_gen_tokens"]  # the throughput counts both
    assert stats["perf/gen_tokens_per_s"] == pytest.approx(generated / stats["perf/gen_seconds"])
    # the learner subtracts it: A = r - r_greedy
    prepared, _ = module.with_advantages(batch)
    torch.testing.assert_close(prepared.advantages, batch.rewards - batch.reward_baselines)
    assert (prepared.advantages != 0).any()


def test_gdpo_keeps_each_reward_function_apart(quick_config):
    overrides = ("estimator=gdpo", "reward=custom", "reward.clip=null", "reward.overlong.buffer=2",
                 "reward.functions.brevity.fn.target_chars=1",  # two characters or more pay a brevity penalty
                 "rollout.max_new_tokens=2", "rollout.truncated=zero")  # fmt: skip
    # two tokens: every two-digit answer is cut (no room for its end-of-sequence token), on every CPU
    cfg, task, tok, module, dm = policy_and_rollouts(quick_config(*overrides))
    dm.engine.sync(module.policy)
    batch = dm.rollout_for_step(step=0).batch
    assert batch.reward_part_names == ("correct", "brevity", "overlong")
    assert batch.reward_part_weights == (1.0, 0.1, 1.0)
    parts = batch.reward_parts  # [N, 3]
    # the reward is their weighted sum (no clip), the overlong penalty a part of its own
    torch.testing.assert_close(batch.rewards, (parts * torch.tensor([1.0, 0.1, 1.0])).sum(-1))
    lengths = completion_lengths(batch)
    torch.testing.assert_close(parts[:, 2], overlong_penalty(lengths, max_len=2, buffer=2, penalty=1.0))
    # rollout.truncated=zero zeroes every function's reward of a cut sample, as it zeroes their sum
    eos = set(dm.engine.eos_token_ids)
    ended = torch.tensor([bool(eos & set(row)) for row in batch.completion_ids.tolist()])  # [N]
    cut = (lengths == 2) & ~ended  # [N] reached the limit with no end-of-sequence token
    assert cut.any() and (parts[cut, :2] == 0).all()
    texts = [tok.decode(row, skip_special_tokens=True) for row in batch.completion_ids.tolist()]
    brevity = torch.tensor(length_penalty([], texts, target_chars=1))  # [N] by hand, before the rule
    torch.testing.assert_close(parts[~cut, 1], brevity[~cut])
    assert (brevity[cut] != 0).all()  # what the rule zeroed was a live penalty (a cut sample has 2 chars)
    # the learner's advantages are GDPO's of these parts; dynamic sampling asks the same input
    prepared, _ = module.with_advantages(batch)
    k = cfg.rl.samples_per_prompt
    inp = AdvantageInput(batch.rewards.view(-1, k), parts=parts.view(-1, k, 3),
                         part_weights=torch.tensor([1.0, 0.1, 1.0]))  # fmt: skip
    torch.testing.assert_close(prepared.advantages, compute_advantages("gdpo", inp).reshape(-1))
    signal = round_signal(batch, dm.estimator)  # [B] each group alone
    assert signal.tolist() == [bool((compute_advantages("gdpo", inp.groups(slice(g, g + 1))) != 0).any())
                               for g in range(len(signal))]  # fmt: skip


@pytest.mark.parametrize("name", ["remax", "opo"])
def test_dynamic_sampling_hands_the_estimator_its_whole_input(quick_config, name):
    """Each group is judged with what the estimator reads: ReMax's greedy baseline (a uniform group has
    signal when its greedy reward differs), OPO's lengths (refused before: a ValueError on no lengths)."""
    cfg, task, tok, module, dm = policy_and_rollouts(
        quick_config(
            f"estimator={name}", "rl.dynamic_sampling.enabled=true", "rl.dynamic_sampling.max_rounds=2"
        )
    )
    dm.engine.sync(module.policy)
    rollout = dm.rollout_for_step(step=0)
    batch = rollout.batch
    signal = round_signal(batch, dm.estimator)  # [B]
    inp = AdvantageInput.of_batch(batch)
    expected = [bool((dm.estimator(inp.groups(slice(g, g + 1))) != 0).any()) for g in range(len(signal))]
    assert signal.tolist() == expected and rollout.stats["dynamic/rounds"] >= 1
