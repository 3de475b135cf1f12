"""loorl's estimators and policy losses against verl 0.9.1's own functions (`tests/peers.py`), on the
same random inputs: uneven groups, binary and real rewards, right-padded masks with empty sequences,
every aggregation, clip bands on both sides of the ratios drawn. Values and gradients agree to 1e-6.

Where verl and loorl differ by design, the inputs stay where they agree and the docstring says so:
verl has no unscorable sample (no NaN rewards here), gives a lone sample an advantage where loorl
gives 0 (every group here has 2 or more), and whitens over tokens where loorl whitens over samples
(the whitening estimators get one-token completions)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loorl.algo.entropy import top_entropy_mask
from loorl.algo.estimators import AdvantageInput, compute_advantages
from loorl.algo.objectives import AGGREGATIONS, off_policy_sequence_mask, policy_loss
from loorl.settings.training import LossSettings
from loorl.types import RolloutBatch
from loorl.util.wheels import wheel_dir
from peers import STAND_INS, trl_grpo_trainer, verl_core_algos

CASES = 40  # random cases per estimator and per loss
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def verl(model_cache):
    with verl_core_algos(wheel_dir(str(model_cache))) as peer:
        yield peer


def largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ---- estimators --------------------------------------------------------------------------------
def random_groups(seed: int, *, one_token: bool):
    """Rewards [B, K] with `mask` (uneven groups of 2..K samples), completion lengths [B, K], and verl's
    view of the same samples: token-level rewards [N, T] (the score on the last real token), the
    response mask [N, T] and the group index [N], N the real samples in group order."""
    g = torch.Generator().manual_seed(seed)
    b, k = int(torch.randint(1, 7, (), generator=g)), int(torch.randint(2, 9, (), generator=g))
    if seed % 2:
        rewards = torch.randint(0, 2, (b, k), generator=g).double()  # [B, K] a verifier's 0/1
    else:
        rewards = torch.randn(b, k, generator=g, dtype=torch.float64) * 2 + 0.5  # [B, K]
    sizes = torch.randint(2, k + 1, (b,), generator=g)  # [B] every group has 2 or more samples
    mask = torch.arange(k)[None, :] < sizes[:, None]  # [B, K]
    lengths = torch.ones(b, k, dtype=torch.long) if one_token else torch.randint(1, 9, (b, k), generator=g)
    real = mask.flatten()  # [B * K]
    flat_lengths = lengths.flatten()[real]  # [N]
    t = int(flat_lengths.max())
    response_mask = (torch.arange(t)[None, :] < flat_lengths[:, None]).double()  # [N, T]
    token_rewards = torch.zeros_like(response_mask)  # [N, T]
    token_rewards[torch.arange(len(flat_lengths)), flat_lengths - 1] = rewards.flatten()[real]
    index = np.repeat(np.arange(b), sizes.numpy())  # [N]
    return AdvantageInput(rewards, lengths=lengths, mask=mask), (token_rewards, response_mask, index)


def verl_estimator(verl, name: str, token_rewards, response_mask, index) -> torch.Tensor:
    """verl's advantage of each real sample [N] (its token-level advantages are constant over a sample)."""
    c = verl.core_algos
    common = {"token_level_rewards": token_rewards, "response_mask": response_mask, "index": index}
    if name in ("grpo", "dr_grpo"):
        out, _ = c.compute_grpo_outcome_advantage(**common, norm_adv_by_std_in_grpo=name == "grpo")
    elif name == "grpo_passk":
        out, _ = c.compute_grpo_passk_outcome_advantage(**common, config={"norm_adv_by_std_in_grpo": True})
    elif name == "reinforce_pp":
        out, _ = c.compute_reinforce_plus_plus_outcome_advantage(
            token_rewards, response_mask, config=SimpleNamespace(gamma=1.0)
        )
    else:
        fn = {
            "rloo": c.compute_rloo_outcome_advantage,
            "opo": c.compute_opo_outcome_advantage,
            "gpg": c.compute_gpg_outcome_advantage,
            "reinforce_pp_baseline": c.compute_reinforce_plus_plus_baseline_outcome_advantage,
        }[name]
        out, _ = fn(**common)
    return out[:, 0]  # [N]


WHITENING = ("reinforce_pp", "reinforce_pp_baseline")  # verl whitens over tokens: one-token completions
ESTIMATORS = ("rloo", "grpo", "dr_grpo", "opo", "gpg", "grpo_passk", *WHITENING)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimators_match_verl(verl, name):
    worst = 0.0
    for seed in range(CASES):
        inp, verl_view = random_groups(seed, one_token=name in WHITENING)
        # loorl's eps enters as std + eps, verl's whitening as rsqrt(var + 1e-8): compare without
        ours = compute_advantages(name, inp, eps=0.0 if name in WHITENING else 1e-6)  # [B, K]
        theirs = verl_estimator(verl, name, *verl_view)  # [N]
        worst = max(worst, largest(ours[inp.mask], theirs))
    print(f"estimator {name}: {CASES} cases, largest difference {worst:.1e}")
    assert worst <= TOLERANCE


def test_remax_matches_verl(verl):
    """verl's ReMax takes the greedy completion's reward per sample (`reward_baselines` [N]): here each
    sample's group's, as loorl's rollout repeats it over the group's rows."""
    worst = 0.0
    for seed in range(CASES):
        inp, (token_rewards, response_mask, index) = random_groups(seed, one_token=False)
        g = torch.Generator().manual_seed(500 + seed)
        baselines = torch.randn(len(inp.rewards), generator=g, dtype=torch.float64)  # [B]
        ours = compute_advantages("remax", replace(inp, baselines=baselines))  # [B, K]
        theirs, _ = verl.core_algos.compute_remax_outcome_advantage(
            token_level_rewards=token_rewards, reward_baselines=baselines[index], response_mask=response_mask
        )  # [N, T]
        worst = max(worst, largest(ours[inp.mask], theirs[:, 0]))
    print(f"estimator remax: {CASES} cases, largest difference {worst:.1e}")
    assert worst <= TOLERANCE


def test_gdpo_matches_verl(verl):
    """verl's GDPO reads each part from `non_tensor_batch` under `gdpo_reward_keys`, with
    `gdpo_reward_weights`; it whitens over tokens (one-token completions here). eps 1e-12 on both sides:
    verl's whitening adds its own 1e-8 inside the square root, loorl's its eps to the std."""
    worst = 0.0
    for seed in range(CASES):
        inp, (token_rewards, response_mask, index) = random_groups(seed, one_token=True)
        g = torch.Generator().manual_seed(700 + seed)
        d = int(torch.randint(2, 4, (), generator=g))
        parts = torch.randint(0, 2, (*inp.rewards.shape, d), generator=g).double()  # [B, K, D] 0/1 rewards
        parts[..., 0] = inp.rewards  # the first part: the case's own rewards (real-valued in half the cases)
        weights = torch.rand(d, generator=g, dtype=torch.float64) * 2  # [D]
        combined = (parts * weights).sum(-1)  # [B, K]
        ours = compute_advantages("gdpo", replace(inp, rewards=combined, parts=parts, part_weights=weights),
                                  eps=1e-12)  # fmt: skip
        keys = [f"part{i}" for i in range(d)]
        n = len(index)
        theirs, _ = verl.core_algos.compute_gdpo_outcome_advantage(
            token_level_rewards=token_rewards, response_mask=response_mask, index=index, epsilon=1e-12,
            config={"gdpo_reward_keys": keys, "gdpo_reward_weights": weights.tolist()},
            non_tensor_batch={key: parts[..., i][inp.mask].numpy() for i, key in enumerate(keys)},
            batch={"prompts": torch.zeros(n, 2, dtype=torch.long),
                   "attention_mask": torch.ones(n, 3, dtype=torch.long)},
        )  # fmt: skip
        worst = max(worst, largest(ours[inp.mask], theirs[:, 0]))
    print(f"estimator gdpo: {CASES} cases, largest difference {worst:.1e}")
    assert worst <= TOLERANCE


# ---- policy losses -----------------------------------------------------------------------------
def random_tokens(seed: int):
    """log pi [n, C] (float64, a leaf), log pi_old [n, C], advantages [n] and a right-padded mask [n, C]
    with some empty sequences; a few ratios far outside any band."""
    g = torch.Generator().manual_seed(seed)
    n, c = int(torch.randint(1, 7, (), generator=g)), int(torch.randint(1, 10, (), generator=g))
    logp = -torch.rand(n, c, generator=g, dtype=torch.float64) * 3 - 0.02  # [n, C]
    drift = torch.randn(n, c, generator=g, dtype=torch.float64) * (0.05 if seed % 3 == 0 else 0.4)  # [n, C]
    old = (logp + drift).clamp(max=-1e-3)  # [n, C]
    lengths = torch.randint(0, c + 1, (n,), generator=g)  # [n] 0: an empty sequence
    mask = (torch.arange(c)[None, :] < lengths[:, None]).double()  # [n, C]
    adv = torch.randn(n, generator=g, dtype=torch.float64)  # [n]
    adv[torch.rand(n, generator=g) < 0.15] = 0.0
    return logp, old, adv, mask


def settings_for(name: str, seed: int) -> LossSettings:
    """The case's settings: every aggregation the loss takes, clip bands and the losses' own settings."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda *values: values[int(torch.randint(len(values), (), generator=g))]  # noqa: E731
    per_sequence = name in ("sapo", "geo_mean")
    # Clip-Cov's band; an edge at exactly 0 would compare the 1e-8 that verl's mean adds to its count
    # (one sequence: every covariance term is 0 in loorl, +-1e-9 in verl)
    cov_low, cov_high = pick((1.0, 5.0), (0.05, 0.5), (-1.0, 5.0))
    return LossSettings(
        name=name,
        agg="seq-mean-token-mean" if per_sequence else pick(*AGGREGATIONS),
        clip_low=pick(0.2, 0.1, 0.4), clip_high=pick(0.2, 0.28, 0.05),
        max_len=pick(4, 16), dppo_ratio_cap=pick(20.0, 1.5), sapo_tau_pos=pick(1.0, 2.0),
        sapo_tau_neg=pick(1.05, 3.0), cov_share=pick(2e-4, 0.1, 0.4), clip_cov_low=cov_low,
        clip_cov_high=cov_high, kl_cov_coef=pick(0.1, 1.0), dro_beta=pick(0.1, 2.0),
    )  # fmt: skip


def verl_config(verl, s: LossSettings, n_tokens: float, n_seqs: int, *, dual_clip: float | None = None):
    """verl's ActorConfig for loorl's settings `s`; `vanilla` gets no dual clip (1e9) unless `dual_clip`."""
    ratio_c = s.dppo_ratio_cap if s.name.startswith("dppo") else 1e9 if dual_clip is None else dual_clip
    config = verl.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        clip_ratio=s.clip_low, clip_ratio_low=s.clip_low, clip_ratio_high=s.clip_high, clip_ratio_c=ratio_c,
        tau_pos=s.sapo_tau_pos, tau_neg=s.sapo_tau_neg,
        policy_loss=verl.PolicyLossConfig(
            loss_mode=s.name, clip_cov_ratio=s.cov_share, clip_cov_lb=s.clip_cov_low,
            clip_cov_ub=s.clip_cov_high, kl_cov_ratio=s.cov_share, ppo_kl_coef=s.kl_cov_coef,
            dro_beta=s.dro_beta,
        ),
    )  # fmt: skip
    config.global_batch_info.update(
        dp_size=1, batch_num_tokens=n_tokens, global_batch_size=n_seqs, loss_scale_factor=s.max_len
    )  # verl's aggregation with the whole batch's counts, as loorl's policy_loss gets them
    return config


LOSSES = {  # loorl's name -> verl's registered name
    "clipped": "vanilla", "cispo": "cispo", "dppo_tv": "dppo_tv", "dppo_kl": "dppo_kl", "sapo": "sapo",
    "geo_mean": "geo_mean", "clip_cov": "clip_cov", "kl_cov": "kl_cov", "gpg": "gpg", "dro": "dro",
}  # fmt: skip


def loorl_loss(name, s, logp, old, adv, mask):
    logp = logp.clone().requires_grad_(True)
    batch = RolloutBatch(
        input_ids=torch.zeros(*mask.shape, dtype=torch.long), attention_mask=torch.ones_like(mask),
        completion_mask=mask, sampler_logprobs=old, rewards=torch.zeros(len(adv)), samples_per_prompt=1,
        prompt_len=0, advantages=adv, old_logprobs=old,
    )  # fmt: skip
    loss, stats = policy_loss(
        logp, batch, settings=s, num_tokens=max(float(mask.sum()), 1.0), num_seqs=len(adv)
    )
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return loss.detach(), torch.zeros_like(logp) if grad is None else grad, stats.clipped


def verl_loss(verl, name, s, logp, old, adv, mask, *, dual_clip=None):
    logp = logp.clone().requires_grad_(True)
    config = verl_config(verl, s, max(float(mask.sum()), 1.0), len(adv), dual_clip=dual_clip)
    fn = verl.core_algos.get_policy_loss_fn(LOSSES[name])
    loss, _ = fn(old, logp, adv[:, None].expand_as(logp), mask, loss_agg_mode=s.agg, config=config)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return loss.detach(), torch.zeros_like(logp) if grad is None else grad


@pytest.mark.parametrize("name", LOSSES)
def test_policy_losses_match_verl_in_value_and_gradient(verl, name):
    worst_value = worst_grad = 0.0
    acted = 0  # cases where the loss's clip, mask or penalty changed a token: the branches are exercised
    for seed in range(CASES):
        logp, old, adv, mask = random_tokens(seed)
        s = settings_for(name, seed)
        torch.manual_seed(seed)  # Clip-Cov draws its tokens from torch's generator, in verl's order
        ours, our_grad, clipped = loorl_loss(name, s, logp, old, adv, mask)
        acted += clipped > 0
        torch.manual_seed(seed)
        theirs, their_grad = verl_loss(verl, name, s, logp, old, adv, mask)
        assert math.isfinite(float(ours)) and torch.isfinite(our_grad).all()
        worst_value = max(worst_value, largest(ours, theirs))
        worst_grad = max(worst_grad, largest(our_grad * mask, their_grad * mask))
    print(f"loss {name} (verl {LOSSES[name]}): {CASES} cases ({acted} clipped), largest difference "
          f"{worst_value:.1e} (value), {worst_grad:.1e} (gradient)")  # fmt: skip
    assert worst_value <= TOLERANCE and worst_grad <= TOLERANCE
    assert name in ("sapo", "gpg", "dro") or 0 < acted < CASES  # no clip to act, or some cases each way


def test_the_plug_in_example_loss_is_verls_dual_clip_ppo(verl):
    """docs/extending/loss.md's example, `loss._target_=plugins.research.dual_clip_token_loss`, is verl's
    `vanilla` loss with its default dual clip (clip_ratio_c = 3): the plug-in path is checked too."""
    from plugins.research import DUAL_CLIP

    worst_value = worst_grad = 0.0
    for seed in range(CASES):
        logp, old, adv, mask = random_tokens(seed)
        # half the cases: ratios up to e^1.5 and more, beyond the dual clip
        logp = (logp + 1.5 * (seed % 2)).clamp(max=-1e-3)
        s = settings_for("clipped", seed)
        ours = LossSettings(**{**s.__dict__, "target": "plugins.research.dual_clip_token_loss"})
        value, grad, _ = loorl_loss("clipped", ours, logp, old, adv, mask)
        theirs, their_grad = verl_loss(verl, "clipped", s, logp, old, adv, mask, dual_clip=DUAL_CLIP)
        worst_value = max(worst_value, largest(value, theirs))
        worst_grad = max(worst_grad, largest(grad * mask, their_grad * mask))
    print(f"plug-in dual_clip_token_loss (verl vanilla, clip_ratio_c={DUAL_CLIP}): {CASES} cases, largest "
          f"difference {worst_value:.1e} (value), {worst_grad:.1e} (gradient)")  # fmt: skip
    assert worst_value <= TOLERANCE and worst_grad <= TOLERANCE


# ---- TRL's ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trl(model_cache):
    with trl_grpo_trainer(wheel_dir(str(model_cache))) as grpo_trainer:
        yield grpo_trainer


def test_off_policy_sequence_mask_matches_trl(trl):
    """DeepSeek-V3.2's mask (`loss.off_policy_mask_threshold`) against TRL's `get_off_policy_mask`, with
    NaN sampler log-probs (tokens vLLM could not score) and empty sequences among the cases."""
    differ = dropped = 0
    for seed in range(CASES):
        logp, old, adv, mask = random_tokens(seed)
        sampler = old + 0.3 * (seed % 2)  # half the cases: the sampler 0.3 nats a token more confident
        sampler[torch.rand(sampler.shape, generator=torch.Generator().manual_seed(seed)) < 0.1] = torch.nan
        threshold = (0.05, 0.2, 0.5)[seed % 3]
        ours = off_policy_sequence_mask(adv, logp, sampler, mask, threshold=threshold)  # [n, 1]
        theirs = trl.get_off_policy_mask(adv[:, None], logp, sampler, mask, threshold)  # [n, 1] float
        differ += int((ours != theirs.bool()).sum())
        dropped += int((~ours).sum())
    print(f"off-policy sequence mask (TRL get_off_policy_mask): {CASES} cases, {dropped} sequences dropped, "
          f"{differ} decisions differ")  # fmt: skip
    assert differ == 0 and dropped > 0


def test_top_entropy_mask_matches_trl(trl):
    """`loss.top_entropy_quantile` against TRL's `get_high_entropy_mask` (called with a real single-process
    `accelerate.Accelerator` as its `self.accelerator`, what it gathers with), shares from 0.05 to 1."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    trainer = SimpleNamespace(accelerator=Accelerator(cpu=True))
    differ = 0
    try:
        for seed in range(CASES):
            _, _, _, mask = random_tokens(seed)
            entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) * 3  # [n, C]
            share = (0.05, 0.2, 0.5, 0.8, 1.0)[seed % 5]
            ours = top_entropy_mask(entropy, mask, share)
            theirs = trl.get_high_entropy_mask(
                trainer, entropy, mask, 1 - share
            )  # TRL's threshold: 1 - share
            differ += int((ours != theirs).sum())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the process-wide state it made
        PartialState._reset_state()
    print(f"top-entropy mask (TRL get_high_entropy_mask): {CASES} cases, {differ} tokens differ")
    assert differ == 0


def test_the_stand_ins_leave_no_trace(verl, model_cache):
    """While verl is loaded its imports of Ray and tensordict get stand-ins (loorl installs neither);
    once the oracle is closed, in a fresh interpreter, no verl module, no stand-in and none of verl's
    changes to the environment are left."""
    stood_in = [name for name in STAND_INS if type(sys.modules.get(name)).__name__ == "_StandIn"]
    assert "ray" in stood_in and "tensordict" in stood_in
    assert verl.core_algos.__file__.endswith("verl/trainer/ppo/core_algos.py")
    script = f"""
import os, sys
sys.path[:0] = [{str(Path(__file__).parent)!r}]
from pathlib import Path
from peers import verl_core_algos
before = dict(os.environ)
with verl_core_algos(Path({str(wheel_dir(str(model_cache)))!r})) as peer:
    assert peer.core_algos.compute_rloo_outcome_advantage
left = [name for name in sys.modules if name.split(".")[0] in ("verl", "ray", "tensordict", "codetiming")]
assert not left, left
assert dict(os.environ) == before
print("clean")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("clean"), done.stderr[-2000:]
