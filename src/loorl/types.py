"""The data that crosses the line between the environment (tasks, rollout engines) and the learner
(estimators, losses, the LightningModule): a prompt, the sampler's distribution, a completion, the
padded tensors of one rollout and what the environment hands the learner for one RL step.

Neutral ground: it imports nothing of loorl's, so every layer can use it without pointing upward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch


@dataclass
class Prompt:  # not frozen: Lightning's batch transfer refuses frozen dataclasses
    text: str  # what the policy sees
    answer: str  # the reference answer, used by the reward
    meta: dict = field(default_factory=dict)  # any extra columns a reward function may want


@dataclass(frozen=True)
class Segment:
    """A piece of a warm-start target (`Task.sft_examples`), tokenised on its own as a multi-turn
    rollout appends it; `trained=False` for what the policy reads but does not write (a tool's result)."""

    text: str
    trained: bool = True


@dataclass(frozen=True)
class SamplingConfig:
    """The sampler's whole distribution: engines sample from exactly this, and nothing from the
    model's own generation_config.json; the trainer scores with the same temperature and truncation."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @property
    def score_args(self) -> dict:
        """The arguments of `logprobs.token_logprobs` that make it score this distribution."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass
class Completion:
    token_ids: list[int]  # cut after the first end-of-sequence id (included when present)
    logprobs: list[float]  # the sampler's log-probability of each token
    finished: bool  # True if it ended with EOS, False if cut by the length limit
    # multi-turn rollouts with tools (`loorl.rollout.multi_turn`): 1 on the policy's own tokens, 0 on
    # the tokens inserted between its turns (tool results: no loss, no sampler log-prob); None: all 1
    policy_mask: list[int] | None = None
    tool_calls: tuple = ()  # `loorl.tools.ToolCall`s in the order they were made
    turns: int = 1  # generation turns
    # an environment's `get_reward()` (`environment._target_`): NaN where it failed (unscorable); None:
    # the reward functions grade the sample
    reward: float | None = None
    # a vLLM server's weight versions over its tokens (`rollout.server`): the oldest policy version that
    # sampled any of them, and whether a weight update fell inside it (`pause: keep`); None: the version
    # the request was sent with
    version: int | None = None
    spans_versions: bool = False
    # what went wrong in its environment instance (`loorl.tools.environment.Session.events`: reset_failed,
    # reward_failed, worker_lost, session_lost), counted in the step's `tools/env_*` metrics
    environment_events: tuple = ()
    # the prompt it was generated from where the engine changed its group's (an environment's reset
    # text placed in the last user message, `loorl.rollout.multi_turn`); None: the prompt as encoded
    prompt_ids: list[int] | None = None

    @property
    def inserted(self) -> int:
        """Tokens inserted between turns (tool results)."""
        return 0 if self.policy_mask is None else len(self.policy_mask) - sum(self.policy_mask)

    @property
    def text_ids(self) -> list[int]:
        """The tokens whose text the reward sees: without the end-of-sequence id (which need not
        be a special token that decoding would skip, e.g. a model's second EOS)."""
        return self.token_ids[:-1] if self.finished else self.token_ids


@dataclass
class RolloutBatch:
    """N = num_groups * samples_per_prompt sequences; row g*K + k is sample k of prompt g.

    Each row is the prompt left-padded to P tokens followed by the completion right-padded to C.
    """

    input_ids: torch.Tensor  # [N, P + C]
    attention_mask: torch.Tensor  # [N, P + C]
    completion_mask: torch.Tensor  # [N, C] 1.0 on completion tokens that enter the loss
    sampler_logprobs: torch.Tensor  # [N, C]
    rewards: torch.Tensor  # [N] task reward (NaN = unscorable)
    samples_per_prompt: int
    prompt_len: int
    advantages: torch.Tensor | None = None  # [N] filled in by the learner (module.with_advantages)
    ref_logprobs: torch.Tensor | None = None  # [N, C] when a reference model is loaded
    old_logprobs: torch.Tensor | None = None  # [N, C] when the importance ratio can differ from 1
    correct: torch.Tensor | None = None  # [N] the verifier's verdict (1, 0, NaN: none): what dynamic
    # sampling's set-aside groups were (all right, all wrong)
    # what an estimator's `needs` asked the rollout for (`loorl.algo.estimators.NEEDS`); None otherwise:
    reward_baselines: torch.Tensor | None = None  # [N] the reward of a greedy completion of the row's prompt
    # (ReMax; equal within a group; NaN: unscorable); that completion is never trained on
    reward_parts: torch.Tensor | None = None  # [N, D] each reward function's reward before the weighted
    # sum (GDPO; NaN: unscorable), in `reward_part_names`' order
    reward_part_names: tuple[str, ...] = ()  # the D parts: reward.functions' names (and `overlong`)
    reward_part_weights: tuple[float, ...] = ()  # their weights in the sum
    estimator_groups: torch.Tensor | None = None  # [N] rows with equal ids are one group for the estimator
    # (a prompt whose K `rl.prompt_pools.grow_groups` grew: several groups of K side by side); None: each K
    zero_variance_sign: torch.Tensor | None = None  # [N] RL-ZVP (`loss.zvp_alpha`): +1 where the row's group
    # was rewarded alike above 0, -1 alike at or below 0, 0 where it had spread; None: RL-ZVP off
    temperature: float | None = None  # the sampling temperature that drew the rows, which the trainer scores
    # them at (`rollout.temperature_schedule`); None: the run's one temperature (`rollout.temperature`)

    @property
    def num_groups(self) -> int:
        return self.input_ids.shape[0] // self.samples_per_prompt

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]  # [N, C]

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted from each row's first real token (left padding must not shift them)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P + C]

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        """The rows of whole groups, in the given order."""
        k = self.samples_per_prompt
        return self.select_rows(torch.tensor([g * k + i for g in groups for i in range(k)], dtype=torch.long))

    def select_rows(self, rows: torch.Tensor) -> RolloutBatch:
        """The given rows [n], in order. Rows that are whole groups keep `samples_per_prompt`; any
        other selection (packed micro-batches, whose advantages are already computed) has 1."""
        k = self.samples_per_prompt
        whole = len(rows) % k == 0 and bool(
            (rows.view(-1, k) == rows.view(-1, k)[:, :1] + torch.arange(k)).all()
            and (rows[::k] % k == 0).all()
        )
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            values[f.name] = v[rows.to(v.device)] if isinstance(v, torch.Tensor) else v
        values["samples_per_prompt"] = k if whole else 1
        return RolloutBatch(**values)

    def groups_with_signal(self) -> list[int]:
        """The groups with a nonzero advantage in any row: a group whose every advantage is 0 (all its
        samples rewarded alike, under a group baseline) adds exactly nothing to the policy gradient.
        At least one group is returned, so that a pass still runs (and a data-parallel all-reduce
        still meets its peers)."""
        signal = self.advantages != 0  # [N]
        if self.zero_variance_sign is not None:  # RL-ZVP: a group without spread teaches too
            signal = signal | (self.zero_variance_sign != 0)
        nonzero = signal.view(self.num_groups, self.samples_per_prompt).any(-1)  # [G]
        groups = nonzero.nonzero().flatten().tolist()
        return groups or [0]

    def group_chunks(self, groups_per_chunk: int | None) -> Iterator[RolloutBatch]:
        """The batch in consecutive pieces of whole groups (micro-batches, log-prob passes); the
        batch itself when one piece holds it all (`groups_per_chunk` None or large enough)."""
        size = self.num_groups if groups_per_chunk is None else max(1, groups_per_chunk)
        if size >= self.num_groups:
            yield self
            return
        for start in range(0, self.num_groups, size):
            yield self.select_groups(list(range(start, min(self.num_groups, start + size))))

    def to(self, device) -> RolloutBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        )


@dataclass
class Rollout:
    """What the environment hands the learner for one RL iteration: the batch (prompts, completions,
    sampler log-probs, rewards) and the environment's statistics of it (reward spread, accuracy,
    lengths, generation speed). Not frozen: Lightning's batch transfer calls `to`."""

    step: int  # the RL iteration it belongs to
    batch: RolloutBatch
    stats: dict[str, float] = field(default_factory=dict)
    policy_version: int | None = None  # the RL steps of training behind the weights that sampled it;
    # None: `step` (on-policy). rollout.max_staleness=N: step - N from step N on (the oldest sample's)

    @property
    def policy_lag(self) -> int:
        """How many updates the sampling weights are behind the weights it is trained with."""
        return 0 if self.policy_version is None else self.step - self.policy_version

    def to(self, device) -> Rollout:
        return Rollout(self.step, self.batch.to(device), self.stats, self.policy_version)
