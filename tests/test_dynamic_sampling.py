"""Dynamic sampling with whole groups (`rl.dynamic_sampling`): which groups have signal under each
estimator, how a step's groups are chosen from its rounds, and the DataModule's rounds on the real tiny
model and HF engine: groups are never split, the `[1, 0, 0, 0]` group keeps its one success."""

from __future__ import annotations

import math

import pytest
import torch

from fixtures import tiny_parts
from loorl.algo import estimators
from loorl.build import build_datamodule
from loorl.rollout.batch import assemble, concatenate
from loorl.rollout.dynamic_sampling import (
    SetAside,
    choose_groups,
    groups_with_signal,
    round_signal,
    sample_until_signal,
)
from loorl.types import Completion

nan = math.nan
GROUP_BASELINES = ["rloo", "grpo", "dr_grpo", "reinforce_pp_baseline"]


# ---- which groups have signal -------------------------------------------------------------------
# rows: [1,0,0,0] mixed | [1,1,1,1] all right | [0,0,0,0] all wrong | [1,nan,nan,nan] one scorable |
# [1,0,nan,nan] mixed with two unscorable | [0.5,0.5,0.5,0.5] equal partial rewards
REWARDS = torch.tensor(
    [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, nan, nan, nan], [1, 0, nan, nan], [0.5, 0.5, 0.5, 0.5]]
)


@pytest.mark.parametrize("name", GROUP_BASELINES + ["reinforce_pp"])
def test_a_group_has_signal_when_its_rewards_differ(name):
    """Group baselines, and REINFORCE++'s batch whitening applied to a group alone: signal exactly
    where at least two scorable rewards differ (hand-read from the rows above)."""
    signal = groups_with_signal(REWARDS, estimators.get(name))
    assert signal.tolist() == [True, False, False, False, True, False]


def test_plain_reinforce_has_signal_wherever_a_reward_is_not_zero():
    """No baseline: A = r, so an all-right group pushes its samples up and only all-zero rewards teach
    nothing."""
    signal = groups_with_signal(REWARDS, estimators.get("reinforce"))
    assert signal.tolist() == [True, True, False, True, True, True]


@pytest.mark.parametrize("name", GROUP_BASELINES)
def test_a_group_baseline_signal_is_a_nonzero_advantage_in_the_batch(name):
    """For the group baselines the group alone and the group in the batch agree: the filter keeps
    exactly the groups `skip_zero_advantage` would train."""
    in_batch = (estimators.compute_advantages(name, REWARDS) != 0).any(-1)  # [B]
    assert groups_with_signal(REWARDS, estimators.get(name)).tolist() == in_batch.tolist()


def test_set_aside_groups_are_counted_by_kind():
    correct = torch.tensor(
        [[1, 1, 1, 1], [0, 0, 0, 0], [1, nan, nan, nan], [nan, nan, nan, nan], [0, 0, nan, 0]]
    )
    assert SetAside.of(correct) == SetAside(all_right=2, all_wrong=2, other=1)


# ---- choosing a step's groups from its rounds ----------------------------------------------------
def test_groups_with_signal_come_first_in_round_order_then_fillers():
    rounds = [torch.tensor([True, False, False, True]), torch.tensor([False, True, True, True])]
    choice = choose_groups(rounds, quota=4)
    assert choice.trained == [(0, 0), (0, 3), (1, 1), (1, 2)]
    assert (choice.fillers, choice.surplus) == (0, 1)  # round 1's group 3 is left over
    short = choose_groups([torch.tensor([False, True, False, False])], quota=4)
    assert short.trained == [(0, 1), (0, 0), (0, 2), (0, 3)] and short.fillers == 3  # topped up, whole


def _batch(rewards: list[list[float]], *, prompt_len: int, completion_len: int, first_token: int):
    """A round's batch: one prompt per group (its length `prompt_len`), K completions of
    `completion_len` tokens whose first token names (group, sample) so rows can be traced."""
    groups = [
        [Completion([first_token + 10 * g + i] + [7] * (completion_len - 1), [-0.5] * completion_len, True)
         for i in range(len(row))]
        for g, row in enumerate(rewards)
    ]  # fmt: skip
    prompts = [[3 + g] * prompt_len for g in range(len(rewards))]
    return prompts, groups, torch.tensor(rewards)


def test_rounds_concatenate_as_if_assembled_together():
    """Rounds padded to different widths, concatenated, equal one `assemble` of all their groups."""
    a = _batch([[1, 0, 0, 0], [0, 0, 0, 0]], prompt_len=3, completion_len=2, first_token=100)
    b = _batch([[1, 1, 0, 1]], prompt_len=5, completion_len=4, first_token=200)
    one = assemble(a[0] + b[0], a[1] + b[1], pad_token_id=0, rewards=torch.cat([a[2], b[2]]))
    parts = [assemble(*x[:2], pad_token_id=0, rewards=x[2]) for x in (a, b)]
    joined = concatenate(parts, pad_token_id=0)
    for name in ("input_ids", "attention_mask", "completion_mask", "sampler_logprobs", "rewards"):
        assert torch.equal(getattr(joined, name), getattr(one, name)), name
    assert (joined.prompt_len, joined.samples_per_prompt) == (one.prompt_len, one.samples_per_prompt)


@pytest.mark.parametrize("name", GROUP_BASELINES + ["reinforce_pp", "reinforce"])
def test_a_chosen_group_is_never_split(name):
    """The NeMo-RL #3469 case: a filter that splits groups turns [1, 0, 0, 0] into [0, 0, 0, 0]. Here
    every trained group is all K rows of one round's group, in order, and under a group baseline its
    advantages are those the estimator gives the whole group (the one success keeps its +)."""
    rounds = [
        _batch([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], prompt_len=3, completion_len=2, first_token=100),
        _batch([[0, 0, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0]], prompt_len=4, completion_len=3, first_token=400),
    ]
    batches = [assemble(*r[:2], pad_token_id=0, rewards=r[2]) for r in rounds]
    estimator = estimators.get(name)
    signal = [groups_with_signal(b.rewards.view(-1, 4), estimator) for b in batches]
    choice = choose_groups(signal, quota=3)
    chosen = concatenate([batches[r].select_groups([g]) for r, g in choice.trained], pad_token_id=0)
    completions = chosen.completion_ids[:, 0].view(3, 4)  # [G, K] each row's traced first token
    for (r, g), traced in zip(choice.trained, completions):
        base = 100 if r == 0 else 400
        assert traced.tolist() == [base + 10 * g + i for i in range(4)]  # all K samples, from one group
    rewards = chosen.rewards.view(3, 4)
    if name != "reinforce":  # a group baseline or batch whitening: [1, 0, 0, 0] is kept with its success
        assert rewards[0].tolist() == [1, 0, 0, 0] and choice.trained[0] == (0, 0)
    if name in ("rloo", "grpo", "dr_grpo"):  # the group's own baseline: the same advantages in any batch
        for (r, g), got in zip(choice.trained, estimators.compute_advantages(name, rewards)):
            whole = estimators.compute_advantages(name, rounds[r][2][g : g + 1])[0]
            assert torch.equal(got, whole)
    if name != "reinforce":
        assert estimators.compute_advantages(name, rewards)[0, 0] > 0


# ---- the DataModule's rounds on the tiny model ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(quick_config):
    return tiny_parts(quick_config())


def _datamodule(quick_config, tiny, *overrides):
    _, task, path, tok, model = tiny
    cfg = quick_config("rl.dynamic_sampling.enabled=true", *overrides)
    dm = build_datamodule(cfg, task, tok, path)
    dm.engine.sync(model)
    seen = []  # every round's rollout, as the DataModule sampled and graded it
    sample = dm.sampler.sample_and_grade

    def recording(*args, **kwargs):
        seen.append(sample(*args, **kwargs))
        return seen[-1]

    dm.sampler.sample_and_grade = recording
    return cfg, dm, seen


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "reinforce"])
def test_the_datamodule_fills_the_step_with_whole_groups_that_have_signal(quick_config, tiny, name):
    """Real samples of the tiny model (about half right): a step's rounds, its chosen groups, each the
    K rows of one round's group, and its logged counts."""
    cfg, dm, seen = _datamodule(quick_config, tiny, f"estimator={name}", "rl.dynamic_sampling.max_rounds=4")
    rollout = dm.rollout_for_step(step=1)
    b, k = cfg.rl.prompts_per_step, cfg.rl.samples_per_prompt
    batch, stats = rollout.batch, rollout.stats
    assert batch.num_groups == b and batch.samples_per_prompt == k
    rows = {}  # (prompt tokens, completion tokens) of every sampled row -> (round, group)
    for r, sampled in enumerate(seen):
        for i in range(sampled.batch.input_ids.shape[0]):
            rows.setdefault(_row(sampled.batch, i), []).append((r, i // k, i % k))
    for g in range(b):  # each trained group is one sampled group, all K rows in order
        sources = [rows[_row(batch, g * k + i)] for i in range(k)]
        common = set.intersection(*({(r, grp) for r, grp, _ in s} for s in sources))
        assert any(all((r, grp, i) in s for i, s in enumerate(sources)) for r, grp in common)
    signal = groups_with_signal(batch.rewards.view(b, k), estimators.get(name))
    assert stats["dynamic/rounds"] == len(seen) and stats["dynamic/prompts_drawn"] == b * len(seen)
    assert stats["dynamic/groups_with_signal"] == int(signal.sum())
    assert stats["dynamic/groups_with_signal"] + stats["dynamic/filler_groups"] == b
    assert signal[: int(signal.sum())].all()  # fillers come last
    aside = sum(stats[f"dynamic/set_aside_{kind}"] for kind in ("all_right", "all_wrong", "other"))
    total_signal = sum(int(round_signal(s.batch, dm.estimator).sum()) for s in seen)
    assert aside == b * len(seen) - total_signal
    assert stats["dynamic/surplus_groups"] == total_signal - stats["dynamic/groups_with_signal"]
    assert stats["rollout/gen_tokens"] == sum(s.stats["rollout/gen_tokens"] for s in seen)
    assert stats["rollout/samples"] == b * k * len(seen) and seen[0].stats["rollout/samples"] == b * k
    assert stats["rollout/accuracy"] == seen[0].stats["rollout/accuracy"]  # round 0: the policy's draw
    if len(seen) < 4:  # it stopped early: the step is full
        assert stats["dynamic/filler_groups"] == 0


def _row(batch, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    real = batch.attention_mask[i].bool()
    ids = batch.input_ids[i]
    p = batch.prompt_len
    return tuple(ids[:p][real[:p]].tolist()), tuple(ids[p:][real[p:]].tolist())


def test_rounds_are_a_pure_function_of_seed_step_and_round(quick_config, tiny):
    """The prompts and samples of every round are drawn again alike (a resumed run's), and round r's
    prompts are not round 0's."""
    _, first, seen_first = _datamodule(quick_config, tiny, "rl.dynamic_sampling.max_rounds=3")
    _, second, seen_second = _datamodule(quick_config, tiny, "rl.dynamic_sampling.max_rounds=3")
    a, b = first.rollout_for_step(step=2), second.rollout_for_step(step=2)
    assert torch.equal(a.batch.input_ids, b.batch.input_ids) and len(seen_first) == len(seen_second)
    assert [p.text for p in first.sampler.prompts_for_step(2, 1)] != [
        p.text for p in first.sampler.prompts_for_step(2)
    ]
    assert [p.text for p in first.sampler.prompts_for_step(2, 0)] == [
        p.text for p in first.sampler.prompts_for_step(2)
    ]


def test_dynamic_sampling_off_hands_over_the_rollout_as_sampled(quick_config, tiny):
    """Off (the default), `sample_until_signal` is the identity: one round, no `dynamic/` metric, the
    batch as assembled from the one generation call."""
    _, task, path, tok, model = tiny
    dm = build_datamodule(quick_config(), task, tok, path)
    dm.engine.sync(model)
    rollout = dm.sampler.sample_round(1)
    rounds = {"estimator": dm.estimator, "prompts_per_step": 2, "pad_token_id": 0}
    never = {"sample_round": pytest.fail, "sleep": pytest.fail}
    assert sample_until_signal(rollout, settings=dm.rl.dynamic_sampling, **rounds, **never) is rollout
    assert not any(key.startswith("dynamic/") for key in dm.rollout_for_step(step=1).stats)
