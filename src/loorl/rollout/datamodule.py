"""The rollout DataModule: the environment side of RL. One Lightning epoch = one RL iteration.

It draws the step's prompts, samples K completions per prompt from the rollout engine, grades
them (rewards and correctness from one verifier pass) and assembles the batch; the learner
(`PolicyGradientModule`) adds reference log-probs, the KL penalty and the advantages. It reads
nothing of the module: the engine follows the policy through `callbacks.EngineSync`.

The train loader yields one `Rollout` per epoch (`reload_dataloaders_every_n_epochs=1`); the
validation loader yields greedy correctness and sampled pass@k per batch of held-out prompts.
Both generate lazily, as the loop fetches the batch: after the epoch's `on_*_start` hooks have
synced the engine.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from loorl.errors import ConfigError
from loorl.masked import masked_std
from loorl.rewards import TASK_VERIFIER, Graded, RewardComposer, WeightedReward, correctness
from loorl.rollout.batch import Rollout, assemble
from loorl.rollout.engine import Completion, RolloutEngine
from loorl.settings import RLSettings, RolloutSettings
from loorl.tasks.base import Prompt, Task


def rollout_stats(
    graded: Graded, groups: list[list[Completion]], finished: torch.Tensor, gen_seconds: float
) -> dict[str, float]:
    """The environment's statistics of a rollout (the reward mean is logged by the learner).
    `finished` [B, K]: the completions that ended with EOS."""
    rewards = graded.rewards  # [B, K]
    scorable = ~rewards.isnan()  # [B, K]
    lengths = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float)  # [B, K]
    group_std = masked_std(rewards, scorable, dim=-1)  # [B] 0 with < 2 scorable
    return {
        "rollout/reward_std": float(masked_std(rewards, scorable)),
        "rollout/accuracy": float(graded.correct.mean()),
        "rollout/completion_len": float(lengths.mean()),
        "rollout/truncated_frac": float((~finished).float().mean()),
        "rollout/zero_std_group_frac": float((group_std == 0).float().mean()),
        "rollout/unscorable": float(graded.unscorable),
        "perf/gen_tokens_per_s": float(lengths.sum()) / max(gen_seconds, 1e-9),
        "perf/gen_seconds": gen_seconds,
        **(graded.parts if len(graded.parts) > 1 else {}),
    }


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
        pass_k: int = 0,  # validation: sampled pass@k besides greedy accuracy; 0: off
    ) -> None:
        super().__init__()
        self.task, self.tokenizer, self.engine = task, tokenizer, engine
        self.rl, self.settings, self.seed, self.pass_k = rl, rollout, seed, pass_k
        self.rewards = rewards or RewardComposer([WeightedReward("task", TASK_VERIFIER)], task=task)

    # ---- prompts -------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[Prompt]) -> list[list[int]]:
        ids = [self.tokenizer(p.text, add_special_tokens=False).input_ids for p in prompts]
        longest = max(map(len, ids))
        if longest > self.settings.max_prompt_length:
            raise ConfigError(
                f"a prompt has {longest} tokens, more than rollout.max_prompt_length="
                f"{self.settings.max_prompt_length}: raise the limit or shorten the task's prompts"
            )
        return ids

    def prompts_for_step(self, step: int) -> list[Prompt]:
        """The step's prompts, a pure function of (seed, step): a resumed run draws the same ones."""
        return self.task.prompts_for_step(step, self.rl.prompts_per_step, seed=self.seed)

    def setup(self, stage: str) -> None:
        if not getattr(self, "_prepared", False):
            self.task.prepare(self.tokenizer, max_prompt_length=self.settings.max_prompt_length)
            self._prepared = True
        self.eval_prompts = self.task.eval_prompts()
        self.encode_prompts(self.eval_prompts)  # fail early on over-long prompts

    def decode(self, groups: list[list[Completion]]) -> list[list[str]]:
        """Completion texts [B][K], without the end-of-sequence token that ended them."""
        return [[self.tokenizer.decode(c.text_ids, skip_special_tokens=True) for c in g] for g in groups]

    # ---- one RL iteration ----------------------------------------------------------------------
    @torch.no_grad()
    def collect(self, step: int) -> Rollout:
        """Prompts, K completions each from the engine's current weights, their grades, the batch."""
        prompts = self.prompts_for_step(step)
        prompt_ids = self.encode_prompts(prompts)
        t0 = time.perf_counter()
        groups = self.engine.generate(prompt_ids, n=self.rl.samples_per_prompt)
        gen_seconds = time.perf_counter() - t0
        self.engine.sleep()
        graded = self.rewards(prompts, self.decode(groups))  # [B, K] rewards and correctness
        rewards = graded.rewards  # [B, K]
        finished = torch.tensor([[c.finished for c in g] for g in groups])  # [B, K]
        if self.settings.truncated == "zero":
            rewards = torch.where(finished | rewards.isnan(), rewards, torch.zeros_like(rewards))
        batch = assemble(
            prompt_ids,
            groups,
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=rewards,
            loss_on_truncated=self.settings.truncated != "mask",
        )
        return Rollout(step=step, batch=batch, stats=rollout_stats(graded, groups, finished, gen_seconds))

    def train_dataloader(self) -> DataLoader:
        """One item: this epoch's rollout, collected when the loop fetches it."""
        step = self.trainer.current_epoch
        collate = self._under_precision(self.collect)
        return DataLoader([step], batch_size=None, collate_fn=collate, generator=_own_generator())

    def _under_precision(self, fn):
        """`fn` under the precision plugin's autocast (bf16-mixed), so the sampler computes in
        training_step's dtype."""

        def run(item):
            with self.trainer.precision_plugin.forward_context():
                return fn(item)

        return run

    # ---- held-out evaluation -------------------------------------------------------------------
    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.eval_prompts,
            batch_size=self.settings.eval_batch_size,
            collate_fn=self._under_precision(self.evaluate),
            generator=_own_generator(),
        )

    @torch.no_grad()
    def evaluate(self, prompts: list[Prompt]) -> dict[str, torch.Tensor | None]:
        """Greedy correctness [n] and, with `pass_k` > 0, whether any of k samples is correct [n]."""
        ids = self.encode_prompts(prompts)
        greedy = self.decode(self.engine.generate(ids, n=1, greedy=True))
        results = {"correct": correctness(self.task, prompts, greedy).view(-1), "pass_k": None}  # [n]
        if self.pass_k > 0:
            sampled = self.decode(self.engine.generate(ids, n=self.pass_k))
            results["pass_k"] = correctness(self.task, prompts, sampled).amax(-1)  # [n]
        self.engine.sleep()
        return results
