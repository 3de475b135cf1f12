"""The rollout DataModule: the environment side of RL, as Lightning sees it. One Lightning epoch = one
RL iteration.

A thin adapter over the pieces that do the work: `sampling.StepSampler` draws the step's prompts and
samples K completions per prompt from the rollout engine, `grading.Grader` grades them (rewards and
correctness from one verifier pass) and assembles the batch, `dynamic_sampling.sample_until_signal`
adds rounds where groups lack a learning signal, `sample_ahead.SampleAhead` keeps the rollouts sampled
ahead under bounded staleness, and `heldout.heldout_results` evaluates held-out prompts. The learner
(`PolicyGradientModule`) adds reference log-probs, the KL penalty and the advantages. It reads nothing
of the module: the engine follows the policy through `rollout.sync.EngineSync`.

The train loader yields one `Rollout` per epoch (`reload_dataloaders_every_n_epochs=1`); the
validation loader yields greedy correctness and reward, sampled pass@k and maj@k per batch of
held-out prompts (`heldout_results`).
Both generate lazily, as the loop fetches the batch: after the epoch's `on_*_start` hooks have
synced the engine.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from loorl.algo import estimators
from loorl.algo.estimators import Estimator
from loorl.errors import ConfigError
from loorl.parallel.distributed import check_world_divides, rank_and_world
from loorl.rewards import TASK_VERIFIER, RewardComposer, WeightedReward
from loorl.rollout.dynamic_sampling import sample_until_signal
from loorl.rollout.engines.base import RolloutEngine
from loorl.rollout.grading import Grader
from loorl.rollout.heldout import heldout_results
from loorl.rollout.sample_ahead import SampleAhead
from loorl.rollout.sampling import StepSampler, sampler_seed
from loorl.settings import OverlongSettings, RLSettings, RolloutSettings
from loorl.tasks.base import Task
from loorl.types import Prompt, Rollout

__all__ = ["RolloutDataModule", "sampler_seed"]  # sampler_seed: now `sampling`'s, importable from here too


def _own_generator() -> torch.Generator:
    """A DataLoader draws a seed for its workers when iterated, from the global torch RNG unless it
    has a generator of its own; the sampler's random stream must not depend on when that happens."""
    return torch.Generator()


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        *,
        task: Task,
        tokenizer,
        engine: RolloutEngine,
        rl: RLSettings,
        rollout: RolloutSettings,
        rewards: RewardComposer | None = None,
        seed: int = 0,
        pass_k: int = 0,  # validation: sampled pass@k and maj@k besides greedy accuracy; 0: off
        eval_samples: int | None = None,  # n >= pass_k samples per prompt for them; None: pass_k
        eval_split: str = "eval",  # eval: the task's held-out set | train: drawn training prompts
        eval_limit: int | None = None,  # at most this many validation prompts (split=train needs it)
        estimator: Estimator | None = None,  # dynamic sampling asks it which groups have signal; None: rloo
        overlong: OverlongSettings | None = None,  # reward.overlong; None: no overlong penalty
        completion_tokens: int | None = None,  # a sample's limit over all its turns; None: one turn's
    ) -> None:
        super().__init__()
        self.task, self.tokenizer = task, tokenizer
        self.rl, self.settings, self.seed, self.pass_k = rl, rollout, seed, pass_k
        self.eval_samples = pass_k if eval_samples is None else eval_samples
        if pass_k > self.eval_samples:
            raise ConfigError(
                f"pass@k with k={pass_k} needs at least k samples per prompt, not {eval_samples}"
            )
        self.eval_split, self.eval_limit = eval_split, eval_limit
        self.estimator = estimator or estimators.get("rloo")
        needs = estimators.needs(self.estimator)  # what it reads beyond the rewards (ReMax, GDPO)
        grader = Grader(
            task=task,
            tokenizer=tokenizer,
            rewards=rewards or RewardComposer([WeightedReward("task", TASK_VERIFIER)], task=task),
            truncated=rollout.truncated,
            overlong=overlong or OverlongSettings(),
            completion_tokens=completion_tokens or rollout.max_new_tokens,  # the overlong penalty's limit
            keep_parts="parts" in needs,
        )
        self.sampler = StepSampler(
            engine=engine,
            grader=grader,
            rl=rl,
            max_prompt_length=rollout.max_prompt_length,
            seed=seed,
            trainer=self._trainer,
            greedy_baseline="baselines" in needs,
            temperature_at=rollout.temperature_at if rollout.temperature_schedule else None,
        )
        # rollout.max_staleness > 0: the next steps' rollouts, sampled ahead
        self.ahead = SampleAhead(self.sampler, max_staleness=rollout.max_staleness, steps=rl.steps)

    def _trainer(self):
        """The Lightning trainer, once it has attached this DataModule; None before (or without one)."""
        return self.trainer

    @property
    def engine(self) -> RolloutEngine:
        return self.sampler.engine

    @property
    def rewards(self) -> RewardComposer:
        return self.sampler.grader.rewards

    def held_out_prompts(self) -> list[Prompt]:
        """The validation prompts: the task's held-out set, or (`eval_split=train`) `eval_limit`
        training prompts drawn with the run's seed; at most `eval_limit` of them."""
        if self.eval_split == "train":
            if not self.eval_limit:
                raise ConfigError("eval.split=train draws training prompts: set eval.num_prompts to how many")
            return self.task.prompts_for_step(0, self.eval_limit, seed=self.seed)
        return self.task.eval_prompts()[: self.eval_limit]

    def setup(self, stage: str) -> None:
        if not getattr(self, "_prepared", False):
            self.task.prepare(self.tokenizer, max_prompt_length=self.settings.max_prompt_length)
            self._prepared = True
        rank, world = rank_and_world()
        # checked before launch where trainer.devices is a number; "auto" is known only now
        check_world_divides(self.rl.prompts_per_step, self.rl.prompts_per_minibatch, world, "as launched")
        self.eval_prompts = self.held_out_prompts()[rank::world]  # sharded; accuracy is reduced by the
        # learner's MeanMetric (sums and counts over ranks)
        self.sampler.encode_prompts(self.eval_prompts)  # fail early on over-long prompts
        if self.settings.max_staleness and stage in ("fit", "validate"):  # (the run validates step 0 first)
            self.engine.start()  # a sampler process of its own (rollout.devices) starts up meanwhile

    # ---- one RL iteration ----------------------------------------------------------------------
    @torch.no_grad()
    def rollout_for_step(self, step: int) -> Rollout:
        """The rollout step `step` trains on. Synchronous (`rollout.max_staleness=0`): its prompts, K
        completions each from the engine's current weights (step `step`'s), their grades.

        Bounded staleness (`max_staleness=N`, N >= 1): the rollout that was asked for N steps before, with
        the weights of that step (`SampleAhead.take`), and step `step + N`'s asked for now, with these
        weights, kept for that step (and in the checkpoint: `state_dict`). N=1 is one step off. Each
        rollout's prompts and sampler seed are those of its own step, as in the synchronous loop, and its
        weights those of step `step - N`: the result does not depend on timing. Dynamic sampling's further
        rounds (`sample_until_signal`) are sampled with this step's weights, before the next is asked for."""
        if not self.settings.max_staleness:
            rollout = self._with_signal(self.sampler.sample_round(step))
            rollout.stats |= self.engine.weight_sync_stats()
            return rollout
        current = self.ahead.take(step)
        current.stats |= self.engine.weight_sync_stats()
        current = self._with_signal(current)
        self.ahead.ask_ahead(step)
        return current

    def _with_signal(self, first: Rollout) -> Rollout:
        """`first` (the step's round 0) with dynamic sampling's further rounds (`rl.dynamic_sampling`)."""
        return sample_until_signal(
            first,
            settings=self.rl.dynamic_sampling,
            estimator=self.estimator,
            prompts_per_step=self.rl.prompts_per_step,
            sample_round=self.sampler.sample_round,
            sleep=self.engine.sleep,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def sample_and_grade(self, prompts: list[Prompt], *, seed: int, step: int = 0) -> Rollout:
        """K completions of each of `prompts` sampled with `seed` and graded (research probes)."""
        return self.sampler.sample_and_grade(prompts, seed=seed, step=step)

    def train_dataloader(self) -> DataLoader:
        """One item: this epoch's rollout, sampled when the loop fetches it."""
        step = self.trainer.current_epoch
        return DataLoader(
            [step], batch_size=None, collate_fn=self.rollout_for_step, generator=_own_generator()
        )

    # ---- held-out evaluation -------------------------------------------------------------------
    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.eval_prompts,
            batch_size=self.settings.eval_batch_size,
            collate_fn=self.heldout_results,
            generator=_own_generator(),
        )

    def heldout_results(self, prompts: list[Prompt]) -> dict:
        """Held-out metrics of a batch of prompts (`heldout.heldout_results`): the validation loop and
        `src/eval.py` both run this."""
        step = self.trainer.global_step if self.trainer is not None else 0
        return heldout_results(prompts, sampler=self.sampler, pass_k=self.pass_k,
                               eval_samples=self.eval_samples, step=step)  # fmt: skip

    # ---- the run's state -----------------------------------------------------------------------
    # the rollouts sampled ahead (bounded staleness) are part of the run's state: a resume trains on them
    def state_dict(self) -> dict:
        state = self.ahead.state_dict() if self.settings.max_staleness else {}
        task = self.task.state_dict()  # what the steps trained on moved (not the rollouts sampled ahead)
        if task:  # (a curriculum's levels)
            state["task"] = task
        if self.sampler.pools is not None:  # rl.prompt_pools: the pass rates behind the next draws
            state["prompt_pools"] = self.sampler.pools.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.task.load_state_dict(state.get("task", {}))
        if self.sampler.pools is not None:
            self.sampler.pools.load_state_dict(state.get("prompt_pools", {}))
        self.ahead.load_state_dict(state if self.settings.max_staleness else {})

    def teardown(self, stage: str) -> None:
        """After fit (every checkpoint written): a rollout sampled ahead that no step will train on is
        dropped, and a sampler process ends."""
        if stage == "fit":
            self.ahead.clear()
            self.engine.close()
