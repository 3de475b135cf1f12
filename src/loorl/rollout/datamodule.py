"""The rollout DataModule: one Lightning epoch = one RL iteration.

`train_dataloader()` is rebuilt every epoch (`reload_dataloaders_every_n_epochs=1`). Each time it
syncs the engine with the live policy, draws the step's prompts, samples K completions per
prompt, scores them, optionally folds the KL to the reference into the reward, computes the
advantages over whole groups and yields mini-batches of whole groups.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from loorl import estimators
from loorl.errors import ConfigError
from loorl.logprobs import completion_logprobs
from loorl.losses import kl_per_token
from loorl.masked import masked_std
from loorl.rewards import RewardComposer, WeightedReward, correctness, task_reward_fn
from loorl.rollout.batch import RolloutBatch, assemble
from loorl.rollout.engine import Completion, RolloutEngine
from loorl.tasks.base import Prompt, Task

log = logging.getLogger(__name__)

TRUNCATED_MODES = ("score", "zero", "mask")


@dataclass(frozen=True)
class RolloutSettings:
    prompts_per_step: int  # B
    samples_per_prompt: int  # K
    prompts_per_minibatch: int  # whole groups per optimizer step
    epochs_per_rollout: int = 1  # passes over each rollout batch
    estimator: str = "rloo"
    whiten: bool = False
    truncated: str = "score"  # completions cut by the length limit: score | zero | mask
    max_prompt_length: int = 512
    eval_batch_size: int = 256
    pass_k: int = 0  # validation: sampled pass@k besides greedy accuracy; 0: off
    seed: int = 0
    groups_per_score_pass: int = 32  # whole groups per no-grad log-prob pass (reference, policy)
    # True where the sampler's log-probs are the trainer's (HF engine, float32 compute); otherwise
    # the KL folded into the reward needs a forward pass of the trained policy
    sampler_logprobs_exact: bool = True

    @property
    def steps_per_rollout(self) -> int:
        return self.epochs_per_rollout * self.prompts_per_step // self.prompts_per_minibatch


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        *,
        task: Task,
        tokenizer,
        engine: RolloutEngine,
        settings: RolloutSettings,
        rewards: RewardComposer | None = None,
    ) -> None:
        super().__init__()
        self.task, self.tokenizer, self.engine, self.settings = task, tokenizer, engine, settings
        self.rewards = rewards or RewardComposer([WeightedReward("task", task_reward_fn(task))])
        self.last_rollout: RolloutBatch | None = None
        self.last_stats: dict[str, float] = {}

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
        return self.task.prompts_for_step(step, self.settings.prompts_per_step, seed=self.settings.seed)

    def setup(self, stage: str) -> None:
        if not getattr(self, "_prepared", False):
            self.task.prepare(self.tokenizer, max_prompt_length=self.settings.max_prompt_length)
            self._prepared = True
        self.eval_prompts = self.task.eval_prompts()
        self.encode_prompts(self.eval_prompts)  # fail early on over-long prompts

    # ---- one RL iteration ----------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, module, step: int) -> RolloutBatch:
        s = self.settings
        self.engine.sync(module.policy, version=module.global_step)
        prompts = self.prompts_for_step(step)
        prompt_ids = self.encode_prompts(prompts)

        t0 = time.perf_counter()
        groups = self.engine.generate(prompt_ids, n=s.samples_per_prompt)
        gen_seconds = time.perf_counter() - t0
        self.engine.sleep()
        texts = self.decode(groups)

        rewards, failures, reward_parts = self.rewards(prompts, texts)  # [B, K]
        finished = torch.tensor([[c.finished for c in g] for g in groups])  # [B, K]
        if s.truncated == "zero":
            rewards = torch.where(finished | rewards.isnan(), rewards, torch.zeros_like(rewards))
        correct = correctness(self.task.is_correct, prompts, texts)  # [B, K]

        batch = assemble(
            prompt_ids,
            groups,
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=rewards,
            advantages=torch.zeros_like(rewards),
            loss_on_truncated=s.truncated != "mask",
        ).to(module.device)
        mask = batch.completion_mask  # [N, C]

        shaped = batch.rewards  # [N] the reward the estimator sees
        kl_seq = None
        score = {"sampling": self.engine.sampling, "groups_per_pass": s.groups_per_score_pass}
        policy_logprobs = None  # [N, C] the trained policy's, where they can differ from the sampler's
        if s.steps_per_rollout > 1 or (module.reference is not None and not s.sampler_logprobs_exact):
            policy_logprobs = completion_logprobs(module.policy, batch, **score)  # [N, C]
        if s.steps_per_rollout > 1:
            batch.old_logprobs = policy_logprobs
        if module.reference is not None:
            ref_device = next(module.reference.parameters()).device  # the CPU when offloaded
            batch.ref_logprobs = completion_logprobs(module.reference, batch.to(ref_device), **score).to(
                module.device
            )  # [N, C]
            logp = batch.sampler_logprobs if policy_logprobs is None else policy_logprobs  # [N, C]
            kl_tok = kl_per_token(logp, batch.ref_logprobs, estimator=module.kl.estimator)  # [N, C]
            kl_seq = torch.where(mask.bool(), kl_tok, 0.0).sum(-1)  # [N]
            if module.kl.in_reward:
                shaped = shaped - module.kl_controller.value * kl_seq
        batch.advantages = estimators.compute_advantages(
            s.estimator, shaped.view(-1, s.samples_per_prompt), whiten=s.whiten
        ).reshape(-1)  # [N]

        lengths = torch.tensor([[len(c.token_ids) for c in g] for g in groups], dtype=torch.float)  # [B, K]
        scorable = ~rewards.isnan()  # [B, K]
        group_std = masked_std(rewards, scorable, dim=-1)  # [B] 0 with < 2 scorable
        # (the reward mean is logged by the module as `rollout/reward`, a torchmetrics MeanMetric)
        self.last_stats = {
            "rollout/reward_std": float(masked_std(rewards, scorable)),
            "rollout/accuracy": float(correct.mean()),
            "rollout/completion_len": float(lengths.mean()),
            "rollout/truncated_frac": float((~finished).float().mean()),
            "rollout/zero_std_group_frac": float((group_std == 0).float().mean()),
            "rollout/unscorable": float(failures),
            "rollout/advantage_abs_mean": float(batch.advantages.abs().mean()),
            "perf/gen_tokens_per_s": float(lengths.sum()) / max(gen_seconds, 1e-9),
            "perf/gen_seconds": gen_seconds,
            **(reward_parts if len(reward_parts) > 1 else {}),
        }
        if kl_seq is not None:
            self.last_stats["rollout/kl"] = float(kl_seq.mean())
            self.last_stats["rollout/kl_coef"] = float(module.kl_controller.value)
            module.kl_controller.update(self.last_stats["rollout/kl"], n_steps=len(kl_seq))
        self.last_rollout = batch
        return batch

    def train_dataloader(self) -> DataLoader:
        s = self.settings
        step = self.trainer.current_epoch
        # the precision plugin's autocast (bf16-mixed): the sampler and the scoring passes compute
        # in the same dtype as training_step
        with self.trainer.precision_plugin.forward_context():
            batch = self.rollout(self.trainer.lightning_module, step)
        # Mini-batches of whole groups: shuffled per pass with a generator seeded by (seed, step).
        gen = torch.Generator().manual_seed(int(np.random.default_rng([s.seed, step, 1]).integers(2**62)))
        minibatches = []
        for _ in range(s.epochs_per_rollout):
            order = torch.randperm(s.prompts_per_step, generator=gen).tolist()
            minibatches += [
                order[i : i + s.prompts_per_minibatch]
                for i in range(0, s.prompts_per_step, s.prompts_per_minibatch)
            ]
        return DataLoader(
            range(s.prompts_per_step), batch_sampler=minibatches, collate_fn=batch.select_groups
        )

    def decode(self, groups: list[list[Completion]]) -> list[list[str]]:
        """Completion texts [B][K], without the end-of-sequence token that ended them."""
        return [[self.tokenizer.decode(c.text_ids, skip_special_tokens=True) for c in g] for g in groups]

    # ---- held-out evaluation -------------------------------------------------------------------
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_prompts, batch_size=self.settings.eval_batch_size, collate_fn=list)

    @torch.no_grad()
    def evaluate(self, policy, prompts: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy correctness [n] and, with `pass_k` > 0, whether any of k samples is correct [n]."""
        self.engine.sync(policy, version=self.trainer.global_step if self.trainer else None)
        ids = self.encode_prompts(prompts)
        greedy = self.engine.generate(ids, n=1, greedy=True)
        correct = correctness(self.task.is_correct, prompts, self.decode(greedy)).view(-1)  # [n]
        pass_k = None
        if self.settings.pass_k > 0:
            groups = self.engine.generate(ids, n=self.settings.pass_k)
            pass_k = correctness(self.task.is_correct, prompts, self.decode(groups)).amax(-1)  # [n]
        self.engine.sleep()
        return correct, pass_k
