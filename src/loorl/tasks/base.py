"""What the rollout loop needs from a task: prompts, an answer checker and (for tiny models) SFT data."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from loorl.types import Prompt


class Task(ABC):
    """A prompt distribution with a reward. Subclasses are instantiated from `conf/task/*.yaml`."""

    name: str = "task"
    # The tools' JSON schemas a prompt rendered with a chat template carries, as its `tools=`
    # (`format_prompt(..., tools=self.prompt_tools)`): the environment's, set by `loorl.build.build_task`
    # before `prepare` when `environment.tools_in_prompt`; None: none (plain-text prompts never carry them)
    prompt_tools: list[dict] | dict[str, list[dict]] | None = None
    route_column: str = "environment"  # with several environments (a dict above): the row's column naming its

    def tools_for(self, columns: dict) -> list[dict] | None:
        """The tools a prompt with these columns carries: `prompt_tools`, or with several environments
        (`environment.routes`) the one its `route_column` names (none for a row that names none)."""
        if isinstance(self.prompt_tools, dict):
            return self.prompt_tools.get(columns.get(self.route_column))
        return self.prompt_tools

    @abstractmethod
    def train_prompts(self, n: int, *, rng: np.random.Generator) -> list[Prompt]:
        """`n` training prompts drawn with `rng` (seeded per step, so a resumed run sees the same prompts)."""

    def prepare(self, tokenizer, *, max_prompt_length: int) -> None:
        """Called once the policy's tokenizer is known (chat templates, length filtering)."""
        return None

    def prompts_for_step(self, step: int, n: int, *, seed: int) -> list[Prompt]:
        """The prompts of RL step `step`: a pure function of (seed, step), so a resumed run draws the same."""
        return self.train_prompts(n, rng=np.random.default_rng([seed, step]))

    def prompts_for_round(self, step: int, round: int, n: int, *, seed: int) -> list[Prompt]:
        """Round `round` of step `step` under dynamic sampling (`rl.dynamic_sampling`): round 0 is the
        step's own prompts, each further round `n` prompts drawn at random, a pure function of (seed,
        step, round), so a resumed run draws the same. (Not the next prompts of an epoch-ordered
        task: those belong to later steps, whatever the filter did.)"""
        if round == 0:
            return self.prompts_for_step(step, n, seed=seed)
        return self.train_prompts(n, rng=np.random.default_rng([seed, step, round]))

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out set for greedy accuracy."""

    @abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float | None:
        """Reward of one completion; None means unscorable."""

    def grade(self, prompt: Prompt, completion: str) -> tuple[float | None, bool]:
        """The verifier's one pass over a completion: (reward, correct). Default: correct when the
        reward is positive. A rollout calls this once per sample for both its reward and accuracy."""
        r = self.reward(prompt, completion)
        return r, r is not None and not math.isnan(r) and r > 0

    def grade_with_tools(self, prompt: Prompt, completion: str, calls) -> tuple[float | None, bool]:
        """`grade` of a multi-turn sample (tools on), which may read the tool calls it made (`calls`:
        `loorl.tools.ToolCall`s, in order) to reward or require their use. Default: `grade`."""
        return self.grade(prompt, completion)

    def grade_many(
        self, prompts: list[Prompt], completions: list[str], tool_calls=None
    ) -> tuple[list[float | None], list[bool], Exception | None]:
        """`grade` over a batch (`grade_with_tools` where `tool_calls`, each sample's calls, is given):
        (rewards, correct, the first error). A sample whose verifier raises gets reward None
        (unscorable) and counts as not correct. Tasks whose verifier is costly per call (running code)
        override this to work on the batch at once."""
        rewards, correct, first = [], [], None
        for i, (p, c) in enumerate(zip(prompts, completions)):
            try:
                r, ok = self.grade(p, c) if tool_calls is None else self.grade_with_tools(p, c, tool_calls[i])
            except Exception as err:  # noqa: BLE001 - a verifier may raise on odd text
                r, ok, first = None, False, first or err
            rewards.append(r)
            correct.append(bool(ok))
        return rewards, correct, first

    def extract_answer(self, prompt: Prompt, completion: str) -> str | None:
        """The completion's final answer as a normalised string, for majority voting (maj@k); None when
        it has none. Default: the stripped completion."""
        return completion.strip() or None

    def votes_on_answers(self, prompt: Prompt) -> bool:
        """Whether maj@k means something for this prompt: its samples' extracted answers can agree (a
        number, a normalised expression). Code tasks say no (see `CodeTask`)."""
        return True

    # ---- the hooks of a task that adapts to the policy (a curriculum; docs/extending/task.md) ------------
    @property
    def source_names(self) -> list[str]:
        """The sources the prompts come from (each prompt's `meta["source"]`), for a task that mixes
        several (`task=mix`, `task=reasoning_gym`): rollout and held-out metrics are logged per source
        too, and `observe` gets each source's outcomes apart. Default: none, one source, the task
        itself."""
        return []

    @property
    def eval_source_names(self) -> list[str]:
        """The sources held-out accuracy is logged under (`val/accuracy/<source>`): `source_names`, and
        the pseudo-sources of held-out sets that training never draws from (task=reasoning_gym's
        `eval_levels`: `<name>@L<level>`). A held-out prompt with `meta["in_overall"]` False counts only
        under its source, never in the overall `val/*` metrics. Default: `source_names`."""
        return self.source_names

    def observe(self, step: int, outcomes: dict[str, list[int]]) -> dict[str, float]:
        """A training step's outcomes (1 correct, 0 not; unscorable samples left out), every rank's in
        rank, prompt and sample order: per source (`source_names`), or under the task's `name` for a
        task without sources. Called for every task after each graded round of a step: a task that
        adapts to the policy (a curriculum) moves here, on a step's first call only (dynamic
        sampling's further rounds call again with the same step). A rollout sampled ahead is observed
        when its step trains on it, never when it is dropped for staleness. Returns statistics to log
        with the step. Default: nothing."""
        return {}

    def pass_rate_key(self, prompt: Prompt) -> str:
        """What pass-rate prompt pools (`rl.prompt_pools`) keep a pass rate for: the prompt itself
        (its text) by default. A procedural task whose prompts rarely repeat keys them by what they share
        instead, such as a source and difficulty level (task=reasoning_gym)."""
        return prompt.text

    def state_dict(self) -> dict:
        """What `observe` changed, as plain values (ints, floats, strings, lists, dicts: a checkpoint
        is loaded with `weights_only=True`), kept in every checkpoint; a resume restores it."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (an empty dict from a checkpoint without a task state)."""
        return None

    def run_facts(self) -> dict[str, str]:
        """What a run with this task should state at its start and in its summary (name -> one line),
        such as the sandbox isolation that a code task's programs run under."""
        return {}

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Task accuracy of one completion."""
        return self.grade(prompt, completion)[1]

    def sft_examples(self, n: int, *, rng: np.random.Generator) -> list[tuple[str, str | list]]:
        """(prompt, target completion) pairs for the tiny model's supervised warm start. A target may
        be a list of `loorl.types.Segment`s, to leave parts out of the loss (a tool's result)."""
        prompts = self.train_prompts(n, rng=rng)
        return [(p.text, p.answer) for p in prompts]
