"""Dynamic sampling with whole groups (DAPO; verl `algorithm.filter_groups`): which groups carry a
learning signal, and how a step's groups are chosen from its sampling rounds.

A group teaches nothing when the estimator gives all K of its samples advantage 0. What counts as
"no spread" is the estimator's own: each group is run through it alone, as a batch of one. For the
group baselines (RLOO, GRPO, Dr. GRPO, REINFORCE++-baseline) that is "fewer than 2 distinct
scorable rewards"; for REINFORCE++, whose baseline is the batch, a group alone is whitened over
itself, so the same groups count as uniform (in a batch they would get the batch-relative
advantage, which a filtered batch gives up); for plain REINFORCE (no baseline) a group has signal
unless every reward is 0. Pure functions, and the rounds themselves (`sample_until_signal`), which
sample through the function they are given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from loorl.algo.estimators import AdvantageInput, Estimator
from loorl.parallel.distributed import all_reduce
from loorl.rollout.batch import concatenate
from loorl.rollout.step_stats import gen_tokens_per_s
from loorl.settings import DynamicSamplingSettings
from loorl.types import Rollout, RolloutBatch


def groups_with_signal(inputs: AdvantageInput | torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """Which of the groups of `inputs` (rewards [B, K], NaN: unscorable, or the whole `AdvantageInput`:
    lengths, greedy baselines, reward parts) have a nonzero advantage under `estimator` when each is the
    whole batch. [B] bool. One estimator call per group: B is a step's prompts."""
    inputs = AdvantageInput.of(inputs)
    groups = range(len(inputs.rewards))
    signal = [bool((estimator(inputs.groups(slice(g, g + 1))) != 0).any()) for g in groups]
    return torch.tensor(signal, dtype=torch.bool)  # [B]


@dataclass(frozen=True)
class SetAside:
    """Groups set aside for want of a spread, by what their samples were."""

    all_right: int = 0  # every scorable sample correct
    all_wrong: int = 0  # every scorable sample wrong
    other: int = 0  # neither (equal partial rewards, unscorable samples only)

    def __add__(self, other: SetAside) -> SetAside:
        return SetAside(self.all_right + other.all_right, self.all_wrong + other.all_wrong,
                        self.other + other.other)  # fmt: skip

    @classmethod
    def of(cls, correct: torch.Tensor) -> SetAside:
        """The kinds of the groups `correct` [G, K] (1 right, 0 wrong, NaN no verdict)."""
        scorable = ~correct.isnan()  # [G, K]
        right = torch.where(scorable, correct, 0.0).sum(-1)  # [G]
        n = scorable.sum(-1)  # [G]
        all_right = int(((right == n) & (n > 0)).sum())
        all_wrong = int(((right == 0) & (n > 0)).sum())
        return cls(all_right, all_wrong, len(correct) - all_right - all_wrong)


@dataclass(frozen=True)
class Choice:
    """A step's groups after its rounds: (round, group) pairs in training order."""

    trained: list[tuple[int, int]]  # groups with signal first (round order), then fillers
    fillers: int  # groups without signal trained because the rounds ran out (max_rounds)
    surplus: int  # groups with signal left over when the last round brought more than needed


def choose_groups(signal_by_round: list[torch.Tensor], quota: int) -> Choice:
    """The `quota` groups a step trains on, from the signal flags [B_r] of each of its rounds: the
    groups with signal in the order they were drawn, and, when fewer than `quota` have one, the
    earliest groups without signal after them (so every rank keeps its B/W groups, and the loss's
    normalisers count what they would without dynamic sampling). Groups are never split: each is a
    (round, index) pair whose K samples come from that round's one generation call."""
    pairs = [(r, g, bool(flag)) for r, flags in enumerate(signal_by_round) for g, flag in enumerate(flags)]
    with_signal = [(r, g) for r, g, flag in pairs if flag]
    without = [(r, g) for r, g, flag in pairs if not flag]
    kept = with_signal[:quota]
    fillers = without[: quota - len(kept)]
    return Choice(kept + fillers, fillers=len(fillers), surplus=len(with_signal) - len(kept))


def round_signal(batch: RolloutBatch, estimator: Estimator) -> torch.Tensor:
    """[B] which groups of a round's batch have signal under the run's estimator."""
    return groups_with_signal(AdvantageInput.of_batch(batch), estimator)


def verdicts(batch: RolloutBatch) -> torch.Tensor:
    """[B, K] the verdicts; all NaN (counted as `other`) for a rollout checkpointed without them."""
    if batch.correct is None:
        return torch.full_like(batch.rewards, torch.nan).view(-1, batch.samples_per_prompt)
    return batch.correct.view(-1, batch.samples_per_prompt)


def sample_until_signal(
    first: Rollout,
    *,
    settings: DynamicSamplingSettings,
    estimator: Estimator,
    prompts_per_step: int,
    sample_round: Callable[[int, int], Rollout],
    sleep: Callable[[], None],
    pad_token_id: int,
) -> Rollout:
    """Dynamic sampling (`rl.dynamic_sampling`; the rollout itself when off): groups of `first` (the
    step's round 0) whose advantages would all be 0 are set aside, and further rounds of B prompts,
    K samples each from one generation call (`sample_round(step, round)`), are drawn with the engine's
    current weights until this step holds B groups with signal on every rank, or `max_rounds` rounds
    have run; `sleep` then puts the engine to sleep. The step trains on B/W groups per rank: those with
    signal, and set-aside ones where too few had (`choose_groups`). The filter looks at the reward the
    estimator sees before any KL term (the task's, with `reward.overlong`): a KL-shaped reward almost
    always has a spread. A collective: every rank calls it.

    One step off, round 0 was sampled a step behind (its lag is the rollout's) and the further
    rounds with this step's weights: the sampler's log-probs are each sample's own, so the
    importance ratio of every row is right. Rounds are a pure function of (seed, step, round) and
    the weights: a resumed run draws the same ones."""
    if not settings.enabled:
        return first
    step, quota = first.step, first.batch.num_groups
    rounds, signal = [first], [round_signal(first.batch, estimator)]

    def missing() -> float:  # groups with signal still lacking, on the rank that lacks the most
        return float(all_reduce(max(quota - sum(int(f.sum()) for f in signal), 0), "max"))

    while len(rounds) < settings.max_rounds and missing() > 0:
        rounds.append(sample_round(step, len(rounds)))
        signal.append(round_signal(rounds[-1].batch, estimator))
    sleep()  # the rounds are over (grading leaves the engine awake under dynamic sampling)
    choice = choose_groups(signal, quota)
    pieces = [rounds[r].batch.select_groups([g]) for r, g in choice.trained]
    batch = concatenate(pieces, pad_token_id=pad_token_id)
    aside = sum(
        (SetAside.of(verdicts(rounds[r].batch)[~flags]) for r, flags in enumerate(signal)),
        start=SetAside(),
    )
    return replace(first, batch=batch, stats=dynamic_sampling_stats(rounds, choice, aside, prompts_per_step))


def dynamic_sampling_stats(
    rounds: list[Rollout], choice: Choice, aside: SetAside, prompts_per_step: int
) -> dict[str, float]:
    """The step's statistics under dynamic sampling: round 0's rollout statistics (the policy on a
    fresh draw of prompts, as without it), the generation totals of every round, and the rounds'
    own counts, summed over ranks. A collective."""
    stats = dict(rounds[0].stats)
    totals = ("rollout/gen_tokens", "rollout/samples", "perf/gen_seconds", "perf/grade_seconds",
              "perf/sampler_gen_seconds")  # fmt: skip
    for key in totals:
        if key in stats:
            stats[key] = sum(r.stats.get(key, 0.0) for r in rounds)
    greedy = sum(r.stats.get("rollout/greedy_gen_tokens", 0.0) for r in rounds)  # ReMax's, every round's
    stats["perf/gen_tokens_per_s"] = gen_tokens_per_s({**stats, "rollout/greedy_gen_tokens": greedy})
    mine = [len(choice.trained) - choice.fillers, choice.fillers, choice.surplus]
    counts = all_reduce(mine + [aside.all_right, aside.all_wrong, aside.other]).tolist()  # all ranks
    signal, fillers, surplus, right, wrong, other = counts
    stats |= {
        "dynamic/rounds": float(len(rounds)),
        "dynamic/prompts_drawn": float(len(rounds) * prompts_per_step),
        "dynamic/groups_with_signal": signal,  # trained
        "dynamic/filler_groups": fillers,  # trained without signal: the rounds ran out
        "dynamic/surplus_groups": surplus,  # with signal, not trained: the last round brought more
        "dynamic/set_aside_all_right": right,
        "dynamic/set_aside_all_wrong": wrong,
        "dynamic/set_aside_other": other,
        "dynamic/gen_tokens_per_trained_group": stats["rollout/gen_tokens"] / max(signal, 1.0),
    }
    return stats
