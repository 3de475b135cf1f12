"""Pass-rate prompt pools (`rl.prompt_pools`): the pools by hand, the draw as a pure function of the
run's seed, step and state, and the DataModule's rounds on the real tiny model (off: the task's own
draw, unchanged)."""

from __future__ import annotations

import pytest
import torch

from fixtures import tiny_parts
from loorl.algo import estimators
from loorl.algo.estimator_registry import AdvantageInput, merged_rows, unmerged
from loorl.build import build_datamodule
from loorl.config import check_config
from loorl.errors import ConfigError
from loorl.rollout.prompt_pools import PromptPools, merge_ids
from loorl.settings.training import PoolWeights, PromptPoolSettings


def _pools(**settings) -> PromptPools:
    return PromptPools(PromptPoolSettings(enabled=True, **settings))


# ---- the pools by hand ---------------------------------------------------------------------------
def test_pools_follow_the_decayed_pass_rate_and_retire():
    pools = _pools(decay=0.5, retire_at=0.9, retire_after=6)
    sizes = pools.observe(["a", "b", "c", "a"], right=[4, 0, 2, 4], scored=[4, 4, 4, 4])
    # a: 8 of 8 (two groups this round), b: 0 of 4, c: 2 of 4
    assert pools.records == {"a": [8.0, 8.0], "b": [0.0, 4.0], "c": [2.0, 4.0]}
    assert [pools.pool_of(k) for k in "abcd"] == ["retired", "hard", "normal", "normal"]  # d: never seen
    assert sizes == {"pools/easy": 0.0, "pools/normal": 1.0, "pools/hard": 1.0, "pools/retired": 1.0}
    # decay 0.5: c's 2 of 4 becomes 1 of 2, then 4 of 4 more: 5 of 6, not yet 0.9; b: 0 of 2 + 4 of 4
    pools.observe(["c", "b"], right=[4, 4], scored=[4, 4])
    assert pools.records["c"] == [5.0, 6.0] and pools.pool_of("c") == "normal"
    assert pools.records["b"] == [4.0, 6.0] and pools.pass_rate("b") == pytest.approx(2 / 3)
    # a group with 3 of 4 right keeps a key easy only at easy_at <= 0.75
    easy = _pools(easy_at=0.75)
    easy.observe(["x"], right=[3], scored=[4])
    assert easy.pool_of("x") == "easy" and "x" not in easy.retired  # retire_at off (None)
    # unscorable samples count in neither: 2 right of 2 scored is all right
    easy.observe(["y"], right=[2], scored=[2])
    assert easy.pass_rate("y") == 1.0


def test_a_retired_key_needs_enough_samples_behind_it():
    pools = _pools(decay=1.0, retire_at=0.9, retire_after=8)
    pools.observe(["a"], right=[4], scored=[4])
    assert pools.pool_of("a") == "easy"  # 4 samples: too few to retire
    pools.observe(["a"], right=[4], scored=[4])
    assert pools.pool_of("a") == "retired"


def test_the_draw_fills_slots_by_pool_weight_then_candidate_order():
    pools = _pools(weights=PoolWeights(easy=0.0, normal=1.0, hard=0.0), retire_at=1.0)
    pools.observe(["e1", "h1", "r1"], right=[4, 0, 4], scored=[4, 4, 4])
    pools.retired.discard("e1")  # e1 easy, h1 hard, r1 retired
    keys = ["e1", "n1", "h1", "n2", "r1", "n3"]
    chosen, stats = pools.choose(keys, 3, seed=0, step=5, round=0)
    assert [keys[i] for i in chosen] == ["n1", "n2", "n3"]  # weight 0: easy and hard wait
    assert stats == {"pools/drawn_easy": 0.0, "pools/drawn_normal": 3.0, "pools/drawn_hard": 0.0,
                     "pools/retired_drawn": 0.0, "pools/grown_groups": 0.0}  # fmt: skip
    # more slots than normal candidates: the weight-0 pools, then a retired one rather than a short step
    chosen, stats = pools.choose(keys, 6, seed=0, step=5, round=0)
    assert sorted(keys[i] for i in chosen) == sorted(keys) and keys[chosen[-1]] == "r1"
    assert stats["pools/retired_drawn"] == 1.0 and stats["pools/drawn_normal"] == 3.0
    assert len(pools.choose(keys, 9, seed=0, step=5, round=0)[0]) == 6  # no candidate twice


def test_the_draw_follows_the_weights_and_is_a_pure_function_of_seed_step_and_round():
    pools = _pools(weights=PoolWeights(easy=1.0, normal=0.0, hard=3.0))
    easy, hard = [f"e{i}" for i in range(400)], [f"h{i}" for i in range(400)]
    pools.observe(easy + hard, right=[4] * 400 + [0] * 400, scored=[4] * 800)
    keys = [k for pair in zip(easy, hard) for k in pair]
    chosen, _ = pools.choose(keys, 400, seed=3, step=7, round=1)
    share_hard = sum(keys[i].startswith("h") for i in chosen) / 400
    assert 0.70 < share_hard < 0.80  # 3:1 (binomial sd 0.02)
    again, _ = pools.choose(keys, 400, seed=3, step=7, round=1)
    other, _ = pools.choose(keys, 400, seed=3, step=7, round=2)
    assert again == chosen and other != chosen


def test_the_state_round_trips_as_plain_values():
    pools = _pools(retire_at=0.9)
    pools.observe(["a", "b"], right=[4, 1], scored=[4, 4])
    state = pools.state_dict()
    assert state == {"records": {"a": [4.0, 4.0], "b": [1.0, 4.0]}, "retired": ["a"]}
    restored = _pools(retire_at=0.9)
    restored.load_state_dict(state)
    assert restored.records == pools.records and restored.retired == pools.retired


# ---- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rl.prompt_pools.hard_at=0.8", "rl.prompt_pools.easy_at=0.5"], "rl.prompt_pools.hard_at=0.8"),
        (["rl.prompt_pools.weights.normal=0"], "rl.prompt_pools.weights are all 0"),
        (
            ["rl.prompt_pools.enabled=true", "rollout.max_staleness=1"],
            "rl.prompt_pools with rollout.max_staleness",
        ),
    ],
)
def test_bad_pool_settings_fail_in_one_line(quick_config, overrides, words):
    with pytest.raises(ConfigError) as err:
        check_config(quick_config(*overrides))
    assert words in str(err.value) and "\n" not in str(err.value)


# ---- the DataModule on the tiny model ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(quick_config):
    return tiny_parts(quick_config())


def _datamodule(quick_config, tiny, *overrides):
    _, task, path, tok, model = tiny
    dm = build_datamodule(quick_config(*overrides), task, tok, path)
    dm.engine.sync(model)
    return dm


def test_off_the_step_draws_the_tasks_prompts(quick_config, tiny):
    dm = _datamodule(quick_config, tiny)
    assert dm.sampler.pools is None and "prompt_pools" not in dm.state_dict()
    b = dm.rl.prompts_per_step
    drawn = [p.text for p in dm.sampler.prompts_for_step(3)]
    assert drawn == [p.text for p in dm.task.prompts_for_round(3, 0, b, seed=dm.seed)]


def test_the_datamodule_learns_pass_rates_and_resumes_its_draws(quick_config, tiny):
    """Real samples of the tiny model: each round updates the pools from its groups; a DataModule given
    the checkpointed state draws the next step's prompts exactly as the one that went on."""
    pools_on = ("rl.prompt_pools.enabled=true", "rl.prompt_pools.retire_at=0.5", "rl.prompt_pools.decay=1.0")
    dm = _datamodule(quick_config, tiny, *pools_on)
    b, k = dm.rl.prompts_per_step, dm.rl.samples_per_prompt
    candidates = dm.task.prompts_for_round(0, 0, b * 4, seed=dm.seed)
    rollout = dm.rollout_for_step(0)
    drawn = dm.sampler.prompts_for_step  # (a draw is logged per round; the round's prompts, again:)
    stats = rollout.stats
    assert sum(stats[f"pools/drawn_{p}"] for p in ("easy", "normal", "hard")) == b  # nothing seen: normal
    right = rollout.batch.correct.view(b, k).nansum(-1)  # [B]
    keys = [dm.task.pass_rate_key(p) for p in candidates[:b]]  # no pool yet: the first B candidates
    assert dm.sampler.pools.records == {key: [float(r), float(k)] for key, r in zip(keys, right.tolist())}
    assert stats["pools/retired"] == float((right >= k / 2).sum())  # retire_at 0.5
    state = dm.state_dict()
    resumed, fresh = _datamodule(quick_config, tiny, *pools_on), _datamodule(quick_config, tiny, *pools_on)
    resumed.load_state_dict(state)
    for step in (0, 1):  # step 0's candidates again: what the pools learned moves the draw
        assert [p.text for p in resumed.sampler.prompts_for_step(step)] == [p.text for p in drawn(step)]
    assert [p.text for p in drawn(0)] != [p.text for p in fresh.sampler.prompts_for_step(0)]
    assert not dm.sampler.pools.retired & {dm.task.pass_rate_key(p) for p in drawn(0)}
    # which keys the tiny model's samples retired depends on the CPU's kernels (none under AVX2): retire
    # one of step 0's prompts by its verdicts, and the draw leaves it out
    first = dm.task.pass_rate_key(drawn(0)[0])
    dm.sampler.pools.observe([first], right=[float(k)], scored=[float(k)])
    assert first in dm.sampler.pools.retired and first not in {dm.task.pass_rate_key(p) for p in drawn(0)}


# ---- a hard prompt's K grown (grow_groups) -------------------------------------------------------------
def test_a_hard_candidate_takes_grow_groups_slots_within_the_budget():
    pools = _pools(grow_groups=3, grow_budget=0.5, weights=PoolWeights(easy=0.0, normal=0.0, hard=1.0))
    pools.observe(["h1", "h2", "h3"], right=[0, 0, 0], scored=[4, 4, 4])
    keys = ["h1", "n1", "h2", "h3", "n2", "n3"]
    chosen, stats = pools.choose(keys, 6, seed=0, step=0, round=0)
    # hard first (weight 1): h1 three times (2 extra), h2 twice (the budget of 3 extra slots runs out), h3
    assert [keys[i] for i in chosen] == ["h1", "h1", "h1", "h2", "h2", "h3"]
    assert stats["pools/grown_groups"] == 3.0 and stats["pools/drawn_hard"] == 3.0
    assert merge_ids(chosen) == [0, 0, 0, 3, 3, 5]
    off = _pools(weights=PoolWeights(easy=0.0, normal=0.0, hard=1.0))  # grow_groups=1: one slot each
    off.observe(["h1", "h2", "h3"], right=[0, 0, 0], scored=[4, 4, 4])
    assert off.choose(keys, 6, seed=0, step=0, round=0)[1]["pools/grown_groups"] == 0.0


def test_merged_groups_are_one_group_for_the_estimator():
    """Two groups of K=2 with one id are one group of 4: RLOO's leave-one-out over all four samples; a
    group of its own is as before. By hand, and against the unmerged estimator on one group per id."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])  # [N]: groups (1, 0) (0, 0) | (1, 0)
    lengths = torch.tensor([3.0, 2.0, 4.0, 1.0, 2.0, 2.0])  # [N]
    ids = torch.tensor([0, 0, 0, 0, 2, 2])  # [N]: the first two groups are one prompt
    inp, index = merged_rows(rewards, lengths, ids)
    assert index.tolist() == [[0, 1, 2, 3], [4, 5, -1, -1]] and inp.mask.tolist()[1] == [
        True,
        True,
        False,
        False,
    ]
    adv = unmerged(estimators.rloo(inp), index, len(rewards))  # [N]
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 1.0, -1.0]))
    # without merging, the all-wrong second group would teach nothing
    plain = estimators.rloo(rewards.view(3, 2)).reshape(-1)
    assert plain[2:4].tolist() == [0.0, 0.0]
    for name in ("grpo", "dr_grpo", "opo", "w_reinforce"):  # each id alone is the estimator on that group
        got = unmerged(estimators.get(name)(inp), index, len(rewards))
        first = estimators.get(name)(AdvantageInput(rewards[:4].view(1, 4), lengths[:4].view(1, 4)))
        torch.testing.assert_close(got[:4], first.view(-1))


def test_a_grown_prompt_reaches_the_learner_as_one_group(quick_config):
    """The DataModule marks a grown prompt's rows with one id (`estimator_groups`) and the learner's
    advantages treat them as one group: step 0's prompts drawn again once the pools saw them."""
    from fixtures import policy_and_rollouts

    grow = [
        f"rl.prompt_pools.{setting}"
        for setting in (
            "enabled=true",
            "hard_at=0.5",
            "grow_groups=2",
            "grow_budget=1.0",
            "weights.hard=1.0",
            "decay=1.0",
        )
    ]
    cfg, task, tok, module, dm = policy_and_rollouts(quick_config(*grow, "loss.zvp_alpha=0.1"))
    dm.engine.sync(module.policy)
    first = dm.rollout_for_step(0)
    assert first.stats["pools/grown_groups"] == 0 and first.batch.estimator_groups is not None
    again = dm.rollout_for_step(0)  # the same candidates: those at most half right are hard now
    batch, k = again.batch, dm.rl.samples_per_prompt
    assert again.stats["pools/grown_groups"] > 0
    ids = batch.estimator_groups.view(-1, k)[:, 0]  # [B] one id per group of K
    assert len(set(ids.tolist())) < len(ids)  # some prompt holds two groups
    prepared, _ = module.with_advantages(batch)
    inp, index = merged_rows(batch.rewards, batch.completion_mask.sum(-1), batch.estimator_groups)
    torch.testing.assert_close(prepared.advantages, unmerged(estimators.rloo(inp), index, len(batch.rewards)))
    # RL-ZVP (loss.zvp_alpha) reads the merged group too: a prompt's rows share one sign, set where all
    # of its 2K samples were rewarded alike (by hand, per id)
    signs, seen = prepared.zero_variance_sign, set()
    for group in batch.estimator_groups.tolist():
        if group in seen:
            continue
        seen.add(group)
        rows = (batch.estimator_groups == group).nonzero().flatten()
        rewards, verdicts = batch.rewards[rows], batch.correct[rows]
        alike = len(set(rewards.tolist())) == 1
        want = 0.0 if not alike else 1.0 if bool((verdicts == 1).all()) else -1.0
        assert signs[rows].tolist() == [want] * len(rows), group
    assert len(seen) < len(batch.rewards) // k  # some prompt held two groups, checked as one
