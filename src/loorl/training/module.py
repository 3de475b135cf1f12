"""The LightningModule: owns the policy, the frozen reference and the KL controller; trains on rollouts.

Data flows one way: the DataModule yields one `Rollout` per RL iteration (prompts, completions,
rewards, correctness: what the environment knows). `training_step` adds what only the learner
knows (reference and old log-probs, the KL penalty, the advantages; `with_advantages`), then takes one
optimizer step per mini-batch of whole groups, each split into micro-batches for memory. Every
micro-batch's loss is normalised by the token and sequence counts of its whole mini-batch, so the
gradient does not depend on the micro-batch size (it would with Lightning's automatic
accumulation, which averages micro-batch means). The engine follows the policy through
`rollout.sync.EngineSync`.

Precision: `model.dtype` is the compute dtype, `model.master_dtype` that of the trainable weights
and the optimizer state (float32 unless the user opts out). bfloat16 compute over float32 weights
runs under Lightning's `bf16-mixed` (autocast), chosen by `loorl.cli.trainer_parts.trainer_precision`: AdamW
updates at lr 1e-6 are mostly below half a bf16 step of a weight and would round to nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import lightning as L
import torch
from torchmetrics import MeanMetric, SumMetric

from loorl.algo.entropy import EntropyCoefficient
from loorl.algo.estimator_registry import merged_rows, unmerged
from loorl.algo.estimators import AdvantageInput
from loorl.algo.kl import AdaptiveKLController, FixedKLController, sequence_kl
from loorl.algo.logprobs import FrozenReference, completion_logprobs, completion_scores
from loorl.algo.objectives import LossStats, policy_loss, token_loss_of
from loorl.algo.zero_variance import zero_variance_signs
from loorl.models.load import load_causal_lm
from loorl.models.lora import AdapterFreeReference, apply_lora, frozen_names
from loorl.parallel.distributed import all_reduce, gather_rows, rank_and_world
from loorl.parallel.fsdp import clip_grad_norm_
from loorl.settings import (
    EstimatorSettings,
    KLSettings,
    LossSettings,
    LRScheduleSettings,
    ModelSettings,
    RLSettings,
)
from loorl.training.batches import microbatches, minibatch_prompts
from loorl.training.lr_schedule import lr_scheduler
from loorl.training.run_identity import IDENTITY_KEY
from loorl.training.validation_metrics import COUNTED_METRICS, VALIDATION_METRICS, log_heldout_metrics
from loorl.types import Rollout, RolloutBatch, SamplingConfig
from loorl.util.autocast import cached_autocast
from loorl.util.profiling import PhaseClock

log = logging.getLogger(__name__)


class PolicyGradientModule(L.LightningModule):
    def __init__(
        self,
        *,
        model_path: str,
        model: ModelSettings,
        optimizer,  # a partial: optimizer(params) -> torch.optim.Optimizer
        rl: RLSettings,
        lr_schedule: LRScheduleSettings | None = None,  # None: constant
        loss: LossSettings,
        kl: KLSettings,
        estimator: EstimatorSettings,
        sampling: SamplingConfig,  # the trainer scores the sampler's distribution (temperature, top-k/p)
        seed: int = 0,
        sampler_logprobs_match_trainer: bool = True,  # RolloutEngine.logprobs_match_trainer (HF, float32)
        identity: dict | None = None,  # checkpoints.run_identity: kept in every checkpoint
    ) -> None:
        super().__init__()
        self.model_path, self.model_settings, self.optimizer_factory = model_path, model, optimizer
        self.rl, self.loss_settings, self.kl, self.estimator = rl, loss, kl, estimator
        self.lr_schedule = lr_schedule or LRScheduleSettings()
        self.sampling, self.seed, self.sampler_logprobs_match_trainer = (
            sampling,
            seed,
            sampler_logprobs_match_trainer,
        )
        self.advantage_fn = estimator.function  # registered, or `estimator._target_`
        self.token_loss = token_loss_of(loss.name, loss.target)  # registered, or `loss._target_`
        self.identity = identity
        self.kl_controller = (
            AdaptiveKLController(kl.coef, kl.target, kl.horizon)
            if kl.adaptive
            else FixedKLController(kl.coef)
        )
        self.entropy_coef = EntropyCoefficient(  # `loss.entropy_*`: fixed, or adapted towards a target
            loss.entropy_coef, loss.entropy_target, loss.entropy_coef_delta, loss.entropy_coef_min,
            loss.entropy_coef_max,
        )  # fmt: skip
        self.automatic_optimization = False
        self.policy = None
        self.reference: FrozenReference | None = None
        self.frozen_names: set[str] = set()  # LoRA: the frozen base weights, left out of checkpoints
        self.reward_mean = MeanMetric()
        # held-out metrics: name -> MeanMetric over prompts (NaN rewards of unscorable samples left out)
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric(nan_strategy="ignore") for name in VALIDATION_METRICS.values()}
        )
        self.val_counts = torch.nn.ModuleDict({name: SumMetric() for name in COUNTED_METRICS.values()})
        self.val_source_accuracy = torch.nn.ModuleDict()  # task=mix: source name -> MeanMetric
        self._grad_norms: list[float] = []
        self.clock = PhaseClock()  # perf/<phase>_seconds of each step (loorl.util.profiling)
        self._step_started = time.perf_counter()  # reset at each epoch start

    # ---- models --------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.policy is not None:  # called again by trainer.fit after trainer.validate
            return
        m = self.model_settings
        if m.master_dtype != "float32":
            log.warning(
                "model.master_dtype=%s: the weights and AdamW state are %s, so updates smaller than half "
                "a %s step of a weight are lost (at lr 1e-6 most of them); model.master_dtype=float32 "
                "keeps them",
                m.master_dtype, m.master_dtype, m.master_dtype,
            )  # fmt: skip
        load = {"attn_implementation": m.attn_implementation}
        dtype = m.master_dtype if m.lora is None else m.lora.base_dtype  # LoRA: frozen weights need no master
        self.policy = load_causal_lm(self.model_path, dtype=dtype, **load)
        self.policy.train()  # from_pretrained returns eval mode; gradient checkpointing needs train mode
        if m.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if m.lora is not None:  # adapters over frozen weights; the optimizer then sees only the adapters
            self.policy = apply_lora(self.policy, m.lora, seed=self.seed, under_autocast=m.dtype != "float32")
            self.frozen_names = {f"policy.{name}" for name in frozen_names(self.policy)}
        strategy = self.trainer.strategy if self._trainer is not None else None
        shard = getattr(strategy, "shard", None)  # strategy=fsdp (loorl.training.strategies.FSDPStrategy)
        if shard is not None:
            shard(self.policy)
        if self.kl.needs_reference and m.lora is not None:
            self.reference = AdapterFreeReference(self.policy)  # the base weights with the adapters off
        elif self.kl.needs_reference:
            frozen = load_causal_lm(self.model_path, dtype=m.ref_dtype, trainable=False, **load)
            if shard is not None and strategy.shard_reference:
                offload = m.ref_offload or strategy.offload_params  # FSDP's CPU offload, not moves
                self.reference = FrozenReference(shard(frozen, offload=offload), offload=False)
            else:
                self.reference = FrozenReference(frozen, offload=m.ref_offload)

    def configure_optimizers(self):
        params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        total = self.rl.steps * self.rl.steps_per_rollout
        # stepped by training_step after each optimizer step (manual optimization); Lightning keeps its
        # state in checkpoints
        return {
            "optimizer": optimizer,
            "lr_scheduler": lr_scheduler(optimizer, self.lr_schedule, total_steps=total),
        }

    # ---- what the learner adds to a rollout ----------------------------------------------------
    def sampling_of(self, batch: RolloutBatch) -> SamplingConfig:
        """The distribution that drew the batch's rows: the run's, at the batch's temperature where
        `rollout.temperature_schedule` moved it."""
        if batch.temperature is None or batch.temperature == self.sampling.temperature:
            return self.sampling
        return replace(self.sampling, temperature=batch.temperature)

    @torch.no_grad()
    def with_advantages(
        self, batch: RolloutBatch, *, stale: bool = False
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Old and reference log-probs, the KL penalty and the advantages of a rollout batch.

        `stale`: the batch was sampled with older weights than the policy's (one step off,
        `rollout.max_staleness=1`). Its old log-probs are then the sampler's, those of the policy that
        produced the samples, so the importance ratio pi / pi_sampler corrects for the lag (the
        clipped surrogate; `auto` picks it whenever old log-probs are set).

        Returns the batch with them filled in, and the rollout metrics they give. Advances the KL
        controller with the measured KL."""
        score = {
            "sampling": self.sampling_of(batch),
            "groups_per_pass": self.rl.prompts_per_microbatch,
            "share_prompt": self.rl.share_prompt,
            "microbatch_tokens": self.rl.microbatch_tokens,  # the same token budget as the training passes
            "chunk_tokens": self.rl.logprob_chunk_tokens,
        }
        off_policy = self.rl.steps_per_rollout > 1
        policy_logprobs = None  # [N, C] the trained policy's, where they can differ from the sampler's
        ref = self.reference
        if off_policy or (
            ref is not None and (stale or ref.kl_from_policy_pass or not self.sampler_logprobs_match_trainer)
        ):
            with cached_autocast(self.device):
                policy_logprobs = completion_logprobs(self.policy, batch, **score)  # [N, C]
        if stale:  # the behaviour policy is the sampler's, whatever the number of passes over the batch
            batch = replace(batch, old_logprobs=batch.sampler_logprobs)
        else:
            batch = replace(batch, old_logprobs=policy_logprobs if off_policy else None)
        # The estimators see the whole step: every rank's rows, gathered in rank order (whitening and
        # the KL controller then match one process on all B groups); this rank keeps its own rows.
        rank, world = rank_and_world()
        lengths = batch.completion_mask.sum(-1)  # [N] tokens in the loss
        columns = [batch.rewards.unsqueeze(-1), lengths.unsqueeze(-1)]  # [N, 1] each
        columns += [
            v.view(len(lengths), -1) for v in (batch.reward_baselines, batch.reward_parts) if v is not None
        ]
        gathered = gather_rows(torch.cat(columns, dim=-1))  # [W*N, 2 (+1) (+D)] one collective
        shaped, lengths, metrics = gathered[:, 0], gathered[:, 1], {}  # [W*N] the reward the estimator sees
        everyone = replace(
            batch,
            reward_baselines=None if batch.reward_baselines is None else gathered[:, 2],  # [W*N]
            reward_parts=None if batch.reward_parts is None else gathered[:, -batch.reward_parts.shape[-1] :],
        )  # what the estimator reads of every rank's rows besides the rewards and lengths
        if self.reference is not None:
            ref = self.reference.completion_logprobs(batch, device=self.device, **score)  # [N, C]
            logp = batch.sampler_logprobs if policy_logprobs is None else policy_logprobs  # [N, C]
            kl_seq = sequence_kl(logp, ref, batch.completion_mask, estimator=self.kl.estimator)  # [N]
            kl_seq = gather_rows(kl_seq)  # [W*N]
            metrics = {"rollout/kl": float(kl_seq.mean()), "rollout/kl_coef": self.kl_controller.value}
            if self.kl.in_reward:
                shaped = shaped - self.kl_controller.value * kl_seq  # [W*N]
            self.kl_controller.update(metrics["rollout/kl"], n_steps=len(kl_seq))
            batch = replace(batch, ref_logprobs=ref)
        if batch.estimator_groups is None:
            inputs = AdvantageInput.of_batch(everyone, shaped, lengths)  # [W*B, K] every rank's groups
            as_groups = lambda rows: rows.view(inputs.rewards.shape)  # noqa: E731  [W*N] -> [W*B, K]
            on_rows = lambda per_group: per_group.reshape(-1)  # noqa: E731  [W*B, K] -> [W*N]
        else:  # a prompt's K grown (rl.prompt_pools.grow_groups): its groups are one for the estimator
            inputs, index = merged_rows(shaped, lengths, gather_rows(batch.estimator_groups))  # [G, M]
            as_groups = lambda rows: torch.where(index >= 0, rows[index.clamp(min=0)], torch.nan)  # noqa: E731
            on_rows = lambda per_group: unmerged(per_group, index, len(shaped))  # noqa: E731  [G, M] -> [W*N]
        advantages = on_rows(self.advantage_fn(inputs, whiten=self.estimator.whiten))  # [W*N]
        metrics["rollout/advantage_abs_mean"] = float(advantages.abs().mean())
        mine = lambda rows: rows.view(world, -1)[rank]  # noqa: E731  [W*N] -> [N] this rank's
        if self.loss_settings.zvp_alpha is not None:  # RL-ZVP: which groups had no spread, and which way
            verdicts = None if batch.correct is None else as_groups(gather_rows(batch.correct))  # [groups]
            signs = zero_variance_signs(inputs, verdicts)  # [W*B, K] or [G, M]
            batch = replace(batch, zero_variance_sign=mine(on_rows(signs)))  # [N]
        return replace(batch, advantages=mine(advantages)), metrics

    # ---- training ------------------------------------------------------------------------------
    def training_step(self, rollout: Rollout, batch_idx: int) -> torch.Tensor:
        """One RL iteration's updates: one optimizer step per mini-batch of whole groups.

        With W data-parallel ranks, `rollout` holds this rank's B/W groups; each global mini-batch
        is M/W groups from every rank (`minibatch_prompts`), normalised by the global counts."""
        clock = self.clock
        with clock.phase("prepare"):  # the phase's name in perf/prepare_seconds
            batch, rollout_metrics = self.with_advantages(rollout.batch, stale=rollout.policy_lag > 0)
        t0 = time.perf_counter()
        opt, stats = self.optimizers(), LossStats()
        world = rank_and_world()[1]
        for groups in minibatch_prompts(self.rl, seed=self.seed, step=rollout.step, world_size=world):
            step_stats = self.accumulate_gradients(batch.select_groups(groups), self.manual_backward)
            stats += step_stats
            if self.entropy_coef.target is not None:  # the mean token entropy of all ranks' mini-batch
                entropy, tokens = all_reduce([step_stats.entropy, step_stats.tokens]).tolist()
                self.entropy_coef.update(entropy / max(tokens, 1.0))
            lr = opt.param_groups[0]["lr"]  # the rate this step uses
            with clock.phase("optimizer"):
                opt.step()  # clips in on_before_optimizer_step, after a 16-mixed loss scaler unscaled
                opt.zero_grad(set_to_none=True)
                self.lr_schedulers().step()
            stats += LossStats(steps=1)
        if self._grad_norms:
            stats += LossStats(grad_norm=sum(self._grad_norms))
            self._grad_norms.clear()
        stats = stats.across_ranks()
        rewards = batch.rewards
        self.reward_mean.update(rewards[~rewards.isnan()])  # synced over ranks (sums and counts) on compute
        metrics = {**rollout.stats, **rollout_metrics, **stats.as_metrics(), "train/lr": lr}
        if self.entropy_coef.needs_gradient:
            metrics["train/entropy_coef"] = self.entropy_coef.value  # what the next optimizer step applies
        seconds = float(all_reduce(time.perf_counter() - t0, "max"))
        tokens = float(all_reduce(batch.attention_mask.sum()))  # all ranks'
        metrics["perf/train_tokens_per_s"] = tokens * self.rl.epochs_per_rollout / seconds
        metrics["perf/train_tokens"] = tokens  # prompt and completion tokens of the step's rows
        metrics |= self.step_timing(rollout.stats)
        loss = metrics.pop("train/loss")
        # Every metric is already the whole step's (reduced above, or by the DataModule), identical on
        # all ranks: logged without Lightning's sync_dist, which would average per-rank values.
        # The progress bar's two headline numbers, then everything else.
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=1)
        self.log(
            "rollout/reward", self.reward_mean, on_step=False, on_epoch=True, prog_bar=True, batch_size=1
        )
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1)
        return torch.tensor(loss)

    def accumulate_gradients(self, batch: RolloutBatch, backward) -> LossStats:
        """Backward over a mini-batch in micro-batches of whole groups; returns the summed stats.

        The loss is normalised by the token and sequence counts of the global mini-batch (summed
        over ranks) and its backward scaled by the world size W: DDP and FSDP average gradients
        over ranks, so the update is that of one process on the whole mini-batch."""
        mask = batch.completion_mask  # [N, C]
        counts = all_reduce([mask.sum(), mask.shape[0]]).tolist()
        counts = {"num_tokens": max(counts[0], 1.0), "num_seqs": int(counts[1])}
        world = rank_and_world()[1]
        kl_coef = self.kl_controller.value if self.reference is not None and not self.kl.in_reward else None
        skip = self.rl.skip_zero_advantage and kl_coef is None  # a KL loss term has a gradient on every row
        stats = LossStats()
        for sub in microbatches(batch, self.rl, skip_zero_advantage=skip):
            with self.clock.phase("forward"):  # the policy's pass and the loss on its log-probs
                with cached_autocast(self.device):  # one bf16 copy of each weight, not one per pass
                    logp, entropy = completion_scores(
                        self.policy,
                        sub,
                        sampling=self.sampling_of(sub),
                        share_prompt=self.rl.share_prompt,
                        packed=self.rl.microbatch_tokens is not None,
                        chunk_tokens=self.rl.logprob_chunk_tokens,
                        with_entropy=True,
                        entropy_grad=self.entropy_coef.needs_gradient,
                    )  # [n, C] each; the entropy with a gradient only for an entropy bonus
                loss, micro = policy_loss(
                    logp,
                    sub,
                    settings=self.loss_settings,
                    kl_coef=kl_coef,
                    kl_estimator=self.kl.estimator,
                    token_loss=self.token_loss,
                    entropy=entropy,
                    entropy_coef=self.entropy_coef.value,
                    **counts,
                )
            with self.clock.phase("backward"):
                backward(loss * world if world > 1 else loss)
            stats += micro + LossStats(
                entropy=float(torch.where(sub.completion_mask.bool(), entropy.detach(), 0.0).sum())
            )
        return stats

    def on_train_epoch_start(self) -> None:
        self._step_started = time.perf_counter()  # before the loop fetches (and generates) the rollout

    def step_timing(self, rollout_stats: dict[str, float]) -> dict[str, float]:
        """This step's `perf/<phase>_seconds` (`loorl.util.profiling`), its whole time and the rest."""
        phases = self.clock.pop()
        for key in ("perf/gen_seconds", "perf/grade_seconds"):  # the DataModule's phases
            if key in rollout_stats:
                phases[key] = rollout_stats[key]
        step = time.perf_counter() - self._step_started
        return phases | {"perf/step_seconds": step, "perf/other_seconds": step - sum(phases.values())}

    def on_before_optimizer_step(self, optimizer) -> None:
        """Gradient-norm clipping, where Lightning has already unscaled fp16 gradients."""
        if self.loss_settings.max_grad_norm:
            params = [p for p in self.policy.parameters() if p.grad is not None]
            # Under DDP the gradient is already all-reduced; under FSDP the grads are DTensor shards
            # and the norm of the full gradient is one scalar all-reduce on the mesh's device (also
            # when offload keeps the shards on the CPU and the group is NCCL's).
            norm = clip_grad_norm_(params, max_norm=self.loss_settings.max_grad_norm)
            self._grad_norms.append(norm)

    # ---- held-out evaluation -------------------------------------------------------------------
    def validation_step(self, results: dict, batch_idx: int) -> None:
        """`results`: the DataModule's per-prompt metrics [n], logged as `val/<name>`
        (`loorl.training.validation_metrics.log_heldout_metrics`)."""
        log_heldout_metrics(self, results)

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Without LoRA's frozen base weights: a checkpoint holds the adapters (and the optimizer state,
        which only they have); the base weights are rebuilt from the model files. Every strategy's
        checkpoint (one file, FSDP's shards) and its load go through this and `load_state_dict`."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for name in self.frozen_names:
            state.pop(prefix + name, None)
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Non-strict for the frozen base weights only (LoRA): any other missing or unexpected key is an
        error under `strict`, as it would be without the override."""
        if not self.frozen_names:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k not in self.frozen_names]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"checkpoint does not fit this LoRA policy: missing {missing[:3]}, unexpected "
                f"{result.unexpected_keys[:3]}"
            )
        return result

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["kl_controller"] = self.kl_controller.state_dict()
        checkpoint["entropy_coef"] = self.entropy_coef.state_dict()
        if self.identity is not None:
            checkpoint[IDENTITY_KEY] = self.identity  # checked before a resume loads anything

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "kl_controller" in checkpoint:
            self.kl_controller.load_state_dict(checkpoint["kl_controller"])
        if "entropy_coef" in checkpoint:
            self.entropy_coef.load_state_dict(checkpoint["entropy_coef"])
