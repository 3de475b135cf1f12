"""A step's prompts and their samples: which prompts each rank draws for a step (and for dynamic
sampling's further rounds), the sampler's seed for each generation call, the engine's `generate`
in the precision it asks for, and a step sampled and graded in one call.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from loorl.errors import ConfigError
from loorl.parallel.distributed import rank_and_world, rank_block
from loorl.rollout.engines.base import RolloutEngine
from loorl.rollout.grading import Grader, Outcomes
from loorl.rollout.multi_turn import row_of
from loorl.rollout.prompt_pools import PromptPools, group_counts, merge_ids
from loorl.settings import RLSettings
from loorl.types import Completion, Prompt, Rollout
from loorl.util.profiling import PhaseClock


def sampler_seed(run_seed: int, *phase: str | int, rank: int = 0) -> int:
    """The sampler's seed for one generation call: a pure function of the run's seed, the phase
    (rollout or validation, with its step and batch) and the rank, so every rank draws its own
    samples and a resumed run draws the ones the interrupted run would have."""
    key = [run_seed, *(zlib.crc32(p.encode()) if isinstance(p, str) else p for p in phase), rank]
    return int(np.random.default_rng(key).integers(2**62))


def engine_precision(engine: RolloutEngine, trainer) -> AbstractContextManager:
    """The context `engine.generate` runs in: the trainer's precision plugin's (autocast under
    bf16-mixed) for an engine that generates in the trainer's precision, else none. None for a
    DataModule used without a trainer."""
    if trainer is None or not engine.generates_in_trainer_precision:
        return nullcontext()
    return trainer.precision_plugin.forward_context()


class StepSampler:
    """Samples and grades a step's prompts with `engine`, K (`rl.samples_per_prompt`) completions
    each. `trainer`: returns the Lightning trainer, or None (for `engine_precision`)."""

    def __init__(
        self,
        *,
        engine: RolloutEngine,
        grader: Grader,
        rl: RLSettings,
        max_prompt_length: int,
        seed: int,
        trainer: Callable[[], object],
        greedy_baseline: bool = False,
        temperature_at: Callable[[int], float] | None = None,
    ) -> None:
        self.engine, self.grader, self.rl = engine, grader, rl
        self.greedy_baseline = greedy_baseline  # a greedy completion of each prompt beside its K (ReMax)
        self.temperature_at = temperature_at  # rollout.temperature_schedule: step -> temperature; None: none
        self.task, self.tokenizer = grader.task, grader.tokenizer
        self.max_prompt_length, self.seed, self.trainer = max_prompt_length, seed, trainer
        self.pools = (  # rl.prompt_pools: which of the task's prompts a step spends its samples on
            PromptPools(rl.prompt_pools) if rl.prompt_pools.enabled else None
        )
        self._pooled: dict[tuple[int, int], tuple[list[str], dict]] = {}  # (step, round): keys, choice stats

    # ---- prompts -------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[Prompt]) -> list[list[int]]:
        ids = [self.tokenizer(p.text, add_special_tokens=False).input_ids for p in prompts]
        longest = max(map(len, ids))
        if longest > self.max_prompt_length:
            raise ConfigError(
                f"a prompt has {longest} tokens, more than rollout.max_prompt_length="
                f"{self.max_prompt_length}: raise the limit or shorten the task's prompts"
            )
        return ids

    def sampler_seed(self, *phase: str | int) -> int:
        """This rank's seed for the generation call of `phase` (`sampler_seed`)."""
        return sampler_seed(self.seed, *phase, rank=rank_and_world()[0])

    def prompts_for_step(self, step: int, round: int = 0) -> list[Prompt]:
        """This rank's prompts of the step, a pure function of (seed, step): a resumed run draws the
        same ones. The step draws B prompts; each of the W ranks takes its block of B/W (together
        they are the B prompts of one process, no prompt twice, none left out). `round` > 0: a further
        round of dynamic sampling, B more prompts, a pure function of (seed, step, round)."""
        n = self.rl.prompts_per_step
        if self.pools is None:
            prompts = self.task.prompts_for_round(step, round, n, seed=self.seed)
        else:  # candidates x B of the task's draw, B kept by the pools (the same on every rank)
            candidates = self.task.prompts_for_round(step, round, n * self.pools.s.candidates, seed=self.seed)
            keys = [self.task.pass_rate_key(p) for p in candidates]
            chosen, stats = self.pools.choose(keys, n, seed=self.seed, step=step, round=round)
            prompts = [candidates[i] for i in chosen]
            self._pooled[(step, round)] = ([keys[i] for i in chosen], stats, merge_ids(chosen))
        return [prompts[i] for i in rank_block(len(prompts), *rank_and_world())]

    def rows(self, prompts: list[Prompt]) -> dict:
        """`{"rows": ...}` for an engine that resets an environment per sample with its prompt's row
        (`takes_rows`: `environment._target_`); {} for any other."""
        return {"rows": [row_of(p) for p in prompts]} if self.engine.takes_rows else {}

    # ---- sampling ------------------------------------------------------------------------------
    def use_step_temperature(self, step: int) -> float | None:
        """The engine set to sample at step `step`'s temperature (`rollout.temperature_schedule`), which
        is returned; None (and the engine untouched) without a schedule."""
        if self.temperature_at is None:
            return None
        temperature = self.temperature_at(step)
        self.engine.use_temperature(temperature)
        return temperature

    def precision(self) -> AbstractContextManager:
        """The context the engine generates in (`engine_precision`)."""
        return engine_precision(self.engine, self.trainer())

    def generate(self, prompt_ids: list[list[int]], **kwargs) -> list[list[Completion]]:
        """The engine's `generate`, inside the trainer's precision context (bf16-mixed: autocast) only
        for an engine that asks for it (`generates_in_trainer_precision`: the HF engine, which samples
        with the live policy in training_step's dtype). Grading and reward models run outside it."""
        with self.precision():
            return self.engine.generate(prompt_ids, **kwargs)

    def generate_with_greedy(self, prompt_ids: list[list[int]], **kwargs):
        """The engine's `generate_with_greedy` (K samples and a greedy completion of each prompt, in one
        call where the engine can), in the precision context `generate` uses."""
        with self.precision():
            return self.engine.generate_with_greedy(prompt_ids, **kwargs)

    def graded_rollout(
        self, prompts: list[Prompt], prompt_ids: list[list[int]], groups: list[list[Completion]], *,
        gen_seconds: float, step: int, greedy: list[Completion] | None = None,
    ) -> tuple[Rollout, Outcomes]:  # fmt: skip
        """`Grader.graded_rollout`, the engine put to sleep first (under dynamic sampling the rounds
        put it to sleep once they are over)."""
        if not self.rl.dynamic_sampling.enabled:
            self.engine.sleep()
        return self.grader.graded_rollout(prompts, prompt_ids, groups, gen_seconds=gen_seconds, step=step,
                                          greedy=greedy)  # fmt: skip

    def observed(self, rollout: Rollout, outcomes: Outcomes) -> Rollout:
        """`rollout`, its outcomes given to the task (`Task.observe`: a curriculum moves) and what the
        task logs with them added to its statistics: for a rollout the step trains on."""
        rollout.stats |= self.task.observe(rollout.step, outcomes)
        return rollout

    @torch.no_grad()
    def sample_and_grade(self, prompts: list[Prompt], *, seed: int, step: int = 0) -> Rollout:
        """K completions of each prompt sampled with `seed` (and a greedy one, with `greedy_baseline`),
        graded, assembled into a batch and observed by the task."""
        prompt_ids = self.encode_prompts(prompts)
        temperature = self.use_step_temperature(step)
        clock = PhaseClock()
        k, greedy = self.rl.samples_per_prompt, None
        with clock.phase("gen"):
            if self.greedy_baseline:
                groups, greedy = self.generate_with_greedy(prompt_ids, n=k, seed=seed, **self.rows(prompts))
            else:
                groups = self.generate(prompt_ids, n=k, seed=seed, **self.rows(prompts))
        rollout, outcomes = self.graded_rollout(prompts, prompt_ids, groups, gen_seconds=clock.seconds["gen"],
                                                step=step, greedy=greedy)  # fmt: skip
        if temperature is not None:  # the trainer scores the rows at the temperature that drew them
            rollout.batch.temperature = temperature
            rollout.stats["rollout/temperature"] = temperature
        return self.observed(rollout, outcomes)

    def sample_round(self, step: int, round: int = 0) -> Rollout:
        """Step `step`'s prompts of round `round` (0: the step's own; > 0: dynamic sampling's further
        rounds), K completions each from the engine's current weights, graded and observed."""
        phase = ("rollout", step) if round == 0 else ("rollout", step, round)
        prompts = self.prompts_for_step(step, round)
        rollout = self.sample_and_grade(prompts, seed=self.sampler_seed(*phase), step=step)
        if self.pools is not None:  # every rank's groups update the pools alike
            keys, stats, merged = self._pooled.pop((step, round))
            right, scored = group_counts(rollout.batch)  # [W*B], [W*B] in the order of `keys`
            rollout.stats |= stats | self.pools.observe(keys, right.tolist(), scored.tolist())
            if self.pools.s.grow_groups > 1:  # a grown prompt's groups: one group for the estimator
                mine = [merged[i] for i in rank_block(len(merged), *rank_and_world())]  # [B/W]
                rows = torch.tensor(mine, dtype=torch.long).repeat_interleave(self.rl.samples_per_prompt)
                rollout.batch.estimator_groups = rows  # [N]
        return rollout
