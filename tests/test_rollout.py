"""The HF engine, batch assembly, scoring and the module's gradient on the real tiny Qwen2 model."""

from __future__ import annotations

import math

import pytest
import torch

from fixtures import tiny_parts
from loorl.algo import estimators
from loorl.algo.logprobs import completion_logits, completion_logprobs
from loorl.build import build_datamodule, build_module
from loorl.rollout.batch import assemble
from loorl.rollout.engines.hf_engine import HFEngine
from loorl.rollout.sampling import sampler_seed
from loorl.training.batches import minibatch_prompts
from loorl.types import Completion, Prompt, SamplingConfig


@pytest.fixture(scope="module")
def tiny(quick_config):

    return tiny_parts(quick_config())


def _engine(tok, **sampling):
    return HFEngine(
        SamplingConfig(**{"max_new_tokens": 5, **sampling}),
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )


def _rollout(tiny, *, n=4, temperature=1.0, top_k=0, num_prompts=6):
    cfg, task, _, tok, model = tiny
    engine = _engine(tok, temperature=temperature, top_k=top_k)
    engine.sync(model)
    torch.manual_seed(0)
    prompts = task.eval_prompts()[:num_prompts]
    # prompts of different lengths, so left padding is exercised
    ids = [tok(p.text, add_special_tokens=False).input_ids for p in prompts]
    assert len({len(i) for i in ids}) > 1
    groups = engine.generate(ids, n=n)
    rewards = torch.zeros(num_prompts, n)
    return assemble(ids, groups, pad_token_id=tok.pad_token_id, rewards=rewards, advantages=rewards), groups


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_match_recomputed(tiny, temperature):
    """The trainer's logprobs (left padding, position ids, temperature) equal those the sampler drew with."""
    _, _, _, _, model = tiny
    batch, _ = _rollout(tiny, temperature=temperature)
    sampling = SamplingConfig(max_new_tokens=5, temperature=temperature)
    recomputed = completion_logprobs(model, batch, sampling=sampling)  # [N, C]
    mask = batch.completion_mask.bool()
    assert mask.sum() > 0
    diff = (recomputed - batch.sampler_logprobs)[mask].abs().max()
    assert diff < 1e-4, diff
    chunked = completion_logprobs(model, batch, sampling=sampling, groups_per_pass=2)
    assert torch.allclose(chunked[mask], recomputed[mask], atol=1e-5)


def test_a_seeded_generate_is_reproducible_and_leaves_the_global_stream_alone(tiny):
    _, task, _, tok, model = tiny
    engine = _engine(tok)
    engine.sync(model)
    ids = [tok(p.text, add_special_tokens=False).input_ids for p in task.eval_prompts()[:4]]
    torch.manual_seed(7)
    before = torch.get_rng_state()
    tokens = [[c.token_ids for c in g] for g in engine.generate(ids, n=4, seed=11)]
    assert torch.equal(torch.get_rng_state(), before)  # the trainer's stream did not move
    assert tokens == [[c.token_ids for c in g] for g in engine.generate(ids, n=4, seed=11)]
    assert tokens != [[c.token_ids for c in g] for g in engine.generate(ids, n=4, seed=12)]


def test_sampler_seeds_differ_by_rank_phase_and_step():
    seeds = {
        sampler_seed(0, "rollout", 3, rank=0),
        sampler_seed(0, "rollout", 3, rank=1),  # each rank its own samples
        sampler_seed(0, "rollout", 4, rank=0),
        sampler_seed(0, "validation", 3, rank=0),
        sampler_seed(1, "rollout", 3, rank=0),
    }
    assert len(seeds) == 5
    assert sampler_seed(0, "rollout", 3, rank=1) == sampler_seed(0, "rollout", 3, rank=1)  # a pure function


def test_greedy_equals_argmax_and_cut_at_eos(tiny):
    _, task, _, tok, model = tiny
    engine = _engine(tok)
    engine.sync(model)
    prompts = task.eval_prompts()[:10]
    ids = [tok(p.text, add_special_tokens=False).input_ids for p in prompts]
    groups = engine.generate(ids, n=1, greedy=True)
    for g in groups:
        c = g[0]
        assert c.finished == (c.token_ids[-1] == tok.eos_token_id)
        assert tok.eos_token_id not in c.token_ids[:-1]
    batch = assemble(
        ids, groups, pad_token_id=tok.pad_token_id, rewards=torch.zeros(10), advantages=torch.zeros(10)
    )
    argmax = completion_logits(model, batch).argmax(-1)  # [N, C]
    mask = batch.completion_mask.bool()
    assert torch.equal(argmax[mask], batch.completion_ids[mask])


def test_assemble_layout_and_truncation_modes():
    completions = [
        [Completion([5, 6, 1], [-0.1, -0.2, -0.3], True), Completion([7, 7], [-1.0, -2.0], False)],
        [Completion([1], [-0.5], True), Completion([8, 9, 9], [-0.1, -0.1, -0.1], False)],
    ]
    prompts = [[3, 4, 5], [6]]
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = assemble(prompts, completions, pad_token_id=0, rewards=r, advantages=r)
    assert b.prompt_len == 3 and b.completion_ids.shape == (4, 3) and b.samples_per_prompt == 2
    assert b.input_ids[2].tolist() == [0, 0, 6, 1, 0, 0]  # left-padded prompt, right-padded completion
    assert b.attention_mask[2].tolist() == [0, 0, 1, 1, 0, 0]
    assert b.position_ids[2].tolist()[2:4] == [0, 1]
    assert b.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    masked = assemble(prompts, completions, pad_token_id=0, rewards=r, advantages=r, loss_on_truncated=False)
    assert masked.completion_mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 0, 0]]
    sub = b.select_groups([1])
    assert sub.input_ids.shape[0] == 2 and torch.equal(sub.input_ids, b.input_ids[2:])


def test_reward_failures_are_unscorable_and_counted():
    from loorl.rewards import RewardComposer, WeightedReward

    prompts = [Prompt("a", "1"), Prompt("b", "2")]

    def exact(prompts, completions, **columns):
        if "boom" in completions:
            raise RuntimeError("reward server down")  # fails the batch: retried one sample at a time
        table = {"none": None, "nan": float("nan"), "inf": float("inf")}
        return [table.get(c, float(c == a)) for c, a in zip(completions, columns["answer_col"])]

    for p in prompts:
        p.meta["answer_col"] = p.answer
    composer = RewardComposer([WeightedReward("exact", exact)])
    graded = composer(prompts, [["1", "boom", "none"], ["nan", "2", "inf"]])
    rewards, failures, parts = graded.rewards, graded.unscorable, graded.parts
    assert failures == 4
    assert rewards[0, 0] == 1.0 and rewards[1, 1] == 1.0
    assert torch.isnan(rewards[[0, 0, 1, 1], [1, 2, 0, 2]]).all()
    assert torch.equal(parts["exact"].isnan(), rewards.isnan()) and parts["exact"].nansum() == 2.0
    adv = estimators.get("rloo")(rewards)
    assert not adv.isnan().any() and adv[0, 0] == 0 and adv[1, 1] == 0  # one scorable sample per group


def test_weighted_rewards_combine_and_clip():
    from loorl.rewards import RewardComposer, WeightedReward

    prompts = [Prompt("q", "4")]
    right = WeightedReward(
        "right", lambda prompts, completions, **_: [float(c == "4") for c in completions], 1.0
    )
    short = WeightedReward("short", lambda prompts, completions, **_: [-len(c) for c in completions], 0.5)
    graded = RewardComposer([right, short])(prompts, [["4", "44", "x"]])
    rewards, failures = graded.rewards, graded.unscorable
    assert failures == 0 and rewards.tolist() == [[0.5, -1.0, -0.5]]
    clipped = RewardComposer([right, short], clip=(-0.6, 0.4))(prompts, [["4", "44", "x"]]).rewards
    assert clipped[0].tolist() == pytest.approx([0.4, -0.6, -0.5])


def test_minibatches_keep_groups_together(quick_config, tiny):
    cfg, task, path, tok, _ = tiny
    cfg = quick_config("rl.prompts_per_minibatch=2", "rl.epochs_per_rollout=2")
    dm = build_datamodule(cfg, task, tok, path)
    module = build_module(cfg, path)
    module.configure_model()
    dm.engine.sync(module.policy)
    batch, _ = module.with_advantages(dm.rollout_for_step(step=0).batch)
    assert batch.old_logprobs is not None  # several optimizer steps per rollout: old logprobs recomputed

    seen = []
    k = cfg.rl.samples_per_prompt
    for groups in minibatch_prompts(module.rl, seed=cfg.seed, step=0):
        mb = batch.select_groups(groups)
        assert mb.samples_per_prompt == k and mb.input_ids.shape[0] == 2 * k
        for g in range(mb.num_groups):
            rows = mb.input_ids[g * k : (g + 1) * k, : mb.prompt_len]
            assert (rows == rows[0]).all()  # one prompt per group
            seen.append(rows[0].tolist())
        assert torch.allclose(mb.advantages.view(-1, k).sum(-1), torch.zeros(mb.num_groups), atol=1e-5)
    assert len(seen) == 2 * cfg.rl.prompts_per_step  # every group once per pass, two passes


def _grads(module):
    return torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])


def test_module_gradient_equals_hand_built_estimate_and_ignores_microbatch_size(quick_config, tiny):
    """grad(loss) == -1/N sum_i A_i grad log pi(y_i|x) on the tiny Qwen2 model, for any micro-batch size."""

    cfg, _, path, _, _ = tiny
    batch, _ = _rollout(tiny, n=4, num_prompts=4)
    batch.advantages = torch.randn(batch.input_ids.shape[0])  # [N]
    grads = {}
    for micro in (1, 4):
        module = build_module(quick_config(f"rl.prompts_per_microbatch={micro}"), path)
        module.configure_model()
        module.accumulate_gradients(batch, lambda loss: loss.backward())
        grads[micro] = _grads(module)
    scale = grads[4].abs().max()  # float32 sums in another order: equal to 1e-5 of the gradient's scale
    assert (grads[1] - grads[4]).abs().max() <= 1e-5 * scale

    # the hand-built estimate: one sequence at a time
    model = module.policy
    params = [p for p in model.parameters() if p.requires_grad]
    expected = [torch.zeros_like(p) for p in params]
    n = batch.input_ids.shape[0]
    for i in range(n):
        one = _single_row(batch, i)
        logp = completion_logprobs(model, one, sampling=module.sampling)  # [1, C], at the run's temperature
        seq_logp = (logp * one.completion_mask).sum()
        for e, g in zip(expected, torch.autograd.grad(seq_logp, params)):
            e -= batch.advantages[i] * g / n
    expected = torch.cat([e.flatten() for e in expected])
    # float32 rounding, relative to the gradient's scale (which follows the warm start, so the CPU's
    # kernels: 1.05 under avx2, 7.2 under AVX-512): per element, a coordinate near 0 can be off by a few
    # 1e-6 (2.7e-6 at -0.0051 under AVX-512), and each float32 path is as far (5-8e-6 at scale 1) from
    # the same sums in float64, where the two agree to 4e-7 (RMSNorm computes in float32 either way)
    assert (grads[4] - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("settings", [[], ["loss.tis_cap=2.0"], ["rl.epochs_per_rollout=2"]])
def test_groups_without_signal_skip_the_training_passes_and_change_nothing(quick_config, tiny, settings):
    """Groups whose advantages are all 0 are left out of the forward and backward
    (`rl.skip_zero_advantage`): the loss and the gradient are those of the whole mini-batch."""
    cfg, _, path, _, _ = tiny
    batch, _ = _rollout(tiny, n=4, num_prompts=6)
    advantages = torch.randn(6, 4)  # [G, K]
    advantages[[1, 2, 4]] = 0.0  # three groups rewarded alike: no signal
    batch.advantages = advantages.reshape(-1)  # [N]
    assert batch.groups_with_signal() == [0, 3, 5]
    if "rl.epochs_per_rollout=2" in settings:  # the clipped surrogate, at ratios away from 1
        batch.old_logprobs = batch.sampler_logprobs + 0.1 * torch.randn_like(batch.sampler_logprobs)
    grads, stats, rows = {}, {}, {}
    for skip in (False, True):
        module = build_module(quick_config(f"rl.skip_zero_advantage={skip}", *settings), path)
        module.configure_model()
        seen = []

        def count_rows(module_, args, kwargs, seen=seen):
            seen.append(kwargs["input_ids"].shape[0])

        module.policy.register_forward_pre_hook(count_rows, with_kwargs=True)
        stats[skip] = module.accumulate_gradients(batch, lambda loss: loss.backward())
        grads[skip], rows[skip] = _grads(module), sum(seen)
    assert rows[True] < rows[False]  # fewer rows ran (the shared prompt runs once per group on top)
    scale = grads[False].abs().max()  # the same sums in another order: equal to 1e-5 of the gradient's scale
    assert (grads[True] - grads[False]).abs().max() <= 1e-5 * scale
    assert stats[True].loss == pytest.approx(stats[False].loss, rel=1e-5, abs=1e-8)


def test_a_minibatch_without_signal_still_runs_one_group():
    """Every advantage 0: one group still runs, so a data-parallel backward meets its peers."""
    from loorl.types import RolloutBatch

    n, k = 8, 4
    batch = RolloutBatch(input_ids=torch.zeros(n, 3, dtype=torch.long), attention_mask=torch.ones(n, 3),
                         completion_mask=torch.ones(n, 1), sampler_logprobs=torch.zeros(n, 1),
                         rewards=torch.ones(n), samples_per_prompt=k, prompt_len=2,
                         advantages=torch.zeros(n))  # fmt: skip
    assert batch.groups_with_signal() == [0]


def test_a_kl_loss_term_keeps_every_row(quick_config, tiny):
    """With a KL loss term every row has a gradient: nothing is skipped."""
    cfg, _, path, _, _ = tiny
    batch, _ = _rollout(tiny, n=4, num_prompts=4)
    batch.advantages = torch.zeros(batch.input_ids.shape[0])
    batch.ref_logprobs = batch.sampler_logprobs - 0.05
    module = build_module(quick_config("kl.coef=0.1", "kl.in_reward=false", "kl.estimator=k3"), path)
    module.configure_model()
    seen = []
    module.policy.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[0]),
                                            with_kwargs=True)  # fmt: skip
    module.accumulate_gradients(batch, lambda loss: loss.backward())
    assert _grads(module).abs().sum() > 0
    full = build_module(quick_config("kl.coef=0.1", "kl.in_reward=false", "kl.estimator=k3",
                                     "rl.skip_zero_advantage=false"), path)  # fmt: skip
    full.configure_model()
    seen_full = []
    full.policy.register_forward_pre_hook(lambda m, args, kw: seen_full.append(kw["input_ids"].shape[0]),
                                          with_kwargs=True)  # fmt: skip
    full.accumulate_gradients(batch, lambda loss: loss.backward())
    assert seen == seen_full


def _single_row(batch, i):
    """Row i as a batch of one group of size one."""
    from dataclasses import fields, replace

    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return replace(
        batch,
        **{k: v[i : i + 1] for k, v in values.items() if isinstance(v, torch.Tensor)},
        samples_per_prompt=1,
    )


def test_reward_and_accuracy_of_arithmetic_task():
    from loorl.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(max_operand=9, eval_size=10)
    p = task.eval_prompts()[0]
    assert p.text.endswith("=") and task.reward(p, p.answer) == 1.0 and task.reward(p, "x") == 0.0
    assert task.is_correct(p, f" {p.answer} ") and not task.is_correct(p, p.answer + "0")
    eval_texts = {q.text for q in task.eval_prompts()}
    held_out = ArithmeticTask(max_operand=9, eval_size=10, exclude_eval_from_train=True)
    import numpy as np

    drawn = {q.text for q in held_out.train_prompts(500, rng=np.random.default_rng(0))}
    assert not drawn & eval_texts
    assert math.isclose(len(held_out._train_pairs), 100 - 10)


def test_reference_model_is_loaded_only_when_kl_is_on(quick_config, tiny):

    _, _, path, _, _ = tiny
    off = build_module(quick_config(), path)
    off.configure_model()
    assert off.reference is None
    on = build_module(quick_config("kl.coef=0.01"), path)
    on.configure_model()
    assert on.reference is not None and not any(p.requires_grad for p in on.reference.parameters())


@pytest.mark.parametrize(
    ("log_ratio", "cap", "weight"), [(math.log(3.0), 2.0, 2.0), (math.log(0.5), 2.0, 0.5)]
)
def test_truncated_importance_weights_scale_the_gradient(quick_config, tiny, log_ratio, cap, weight):
    """min(pi_train / pi_sampler, cap) multiplies each token's loss: here a constant ratio per token."""

    _, _, path, _, _ = tiny
    batch, _ = _rollout(tiny, n=4, num_prompts=4)
    batch.advantages = torch.randn(batch.input_ids.shape[0])  # [N]
    plain = build_module(quick_config(), path)
    plain.configure_model()
    with torch.no_grad():
        exact = completion_logprobs(
            plain.policy, batch, sampling=plain.sampling
        )  # [N, C], the run's temperature
    batch.sampler_logprobs = exact - log_ratio  # the sampler saw pi_train / ratio
    plain.accumulate_gradients(batch, lambda loss: loss.backward())
    corrected = build_module(quick_config(f"loss.tis_cap={cap}"), path)
    corrected.configure_model()
    stats = corrected.accumulate_gradients(batch, lambda loss: loss.backward())
    assert torch.allclose(_grads(corrected), weight * _grads(plain), atol=1e-6, rtol=1e-4)
    assert stats.tis_weight / stats.tokens == pytest.approx(weight, rel=1e-4)
    assert stats.log_ratio / stats.tokens == pytest.approx(log_ratio, abs=1e-4)


class _OffsetSampler(HFEngine):
    """The real HF engine whose reported log-probs are off by a constant per token, as a sampler
    with other kernels or precision (vLLM, bf16) reports slightly different ones."""

    OFFSET = 0.5

    def generate(self, prompt_ids, *, n, greedy=False, seed=None):
        groups = super().generate(prompt_ids, n=n, greedy=greedy, seed=seed)
        for group in groups:
            for c in group:
                c.logprobs = [lp + self.OFFSET for lp in c.logprobs]
        return groups


@pytest.mark.parametrize("exact", [False, True])
def test_kl_in_the_reward_uses_the_trainer_logprobs(quick_config, tiny, exact):
    """At step 0 the policy is the reference: the true KL is exactly 0, whatever the sampler says."""
    cfg = quick_config("kl.coef=0.1", "kl.adaptive=true", "kl.target=1.0", "kl.horizon=100")
    _, task, path, tok, _ = tiny
    module = build_module(cfg, path)
    module.configure_model()
    module.sampler_logprobs_match_trainer = exact
    dm = build_datamodule(cfg, task, tok, path)
    base = dm.engine
    dm.sampler.engine = _OffsetSampler(base.sampling, eos_token_ids=base.eos_token_ids, pad_token_id=0)
    dm.setup("fit")
    dm.engine.sync(module.policy)
    batch, metrics = module.with_advantages(dm.rollout_for_step(step=0).batch)
    kl = metrics["rollout/kl"]
    lengths = batch.completion_mask.sum(-1)  # [N]
    if exact:  # told the sampler is exact, the KL is the sampler's offset times the length
        assert kl == pytest.approx(_OffsetSampler.OFFSET * float(lengths.mean()), rel=1e-4)
        return
    assert abs(kl) < 1e-5
    n = batch.input_ids.shape[0]  # the adaptive controller saw that same KL: error clipped to -0.2
    assert module.kl_controller.value == pytest.approx(0.1 * (1 - 0.2 * n / 100))


def test_datamodule_collects_a_rollout_with_a_real_engine_and_no_learner(tiny):
    """The environment side alone: a real HF engine on the tiny model, no LightningModule, no
    Trainer. The verifier runs once per sample and gives both the reward and the accuracy."""
    from loorl.rewards import RewardComposer, WeightedReward

    cfg, task, path, tok, model = tiny
    calls = []

    class CountingTask(type(task)):
        def grade(self, prompt, completion):
            calls.append(completion)
            return super().grade(prompt, completion)

    counting = CountingTask(max_operand=29, eval_size=40)
    dm = build_datamodule(cfg, counting, tok, path)
    assert isinstance(dm.rewards, RewardComposer) and dm.rewards.task is counting
    dm.engine.sync(model)
    rollout = dm.rollout_for_step(step=3)
    b, k = cfg.rl.prompts_per_step, cfg.rl.samples_per_prompt
    assert rollout.step == 3 and rollout.batch.input_ids.shape[0] == b * k
    assert rollout.batch.advantages is None and rollout.batch.ref_logprobs is None  # the learner's part
    assert len(calls) == b * k  # one verifier pass per sample
    assert rollout.stats["rollout/samples"] == b * k  # the samples the step spent
    rewards = rollout.batch.rewards.view(b, k)
    assert rollout.stats["rollout/accuracy"] == pytest.approx(float(rewards.mean()))  # 1/0 reward = correct
    for key in (
        "rollout/reward_std",
        "rollout/completion_len",
        "rollout/truncated_frac",
        "perf/gen_tokens_per_s",
    ):
        assert key in rollout.stats
    again = build_datamodule(cfg, counting, tok, path)
    again.engine.sync(model)
    assert [p.text for p in again.sampler.prompts_for_step(3)] == [
        p.text for p in dm.sampler.prompts_for_step(3)
    ]
    results = dm.heldout_results(counting.eval_prompts()[:10])  # what validation_step receives
    assert results["correct"].shape == (10,) and results["pass_k"].shape == (10,)
    custom = RewardComposer([WeightedReward("task", "task")], task=counting)
    assert custom(dm.sampler.prompts_for_step(0)[:2], [["1", "2"], ["3", "4"]]).correct.shape == (2, 2)


def test_generation_is_split_into_calls_of_whole_groups(tiny):
    """`rollout.batch_size` bounds the rows per decoding call, rounded down to whole groups (a group
    shares one prefill); the split changes nothing but memory: every sample's log-probs are its own
    tokens' under the policy."""
    cfg, task, path, tok, model = tiny
    engine = _engine(tok, max_new_tokens=32)
    engine.sync(model)
    prompts = [tok(p.text, add_special_tokens=False).input_ids for p in task.eval_prompts()[:3]]
    whole = engine.generate(prompts, n=4, seed=7)
    engine.batch_size = 5  # 4 rows (one group) per call: 12 rows in 3 calls
    split = engine.generate(prompts, n=4, seed=7)
    # 3 calls draw other samples from the seeded generator than one call, but every sample's log-probs
    # are its own tokens' under the policy (the split keeps log-probs and rows aligned)
    assert len(split) == len(whole) == 3 and all(len(g) == 4 for g in split)
    for prompt, group in zip(prompts, split):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])  # [1, P + C]
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)  # [C, V]
            own = logp.gather(-1, torch.tensor(c.token_ids).unsqueeze(-1)).squeeze(-1)  # [C]
            assert torch.allclose(own, torch.tensor(c.logprobs), atol=1e-4)
    greedy = engine.generate(prompts, n=1, greedy=True)
    assert all(lp == 0.0 for g in greedy for c in g for lp in c.logprobs)  # greedy: log-probs not kept
