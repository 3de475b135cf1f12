"""The LightningModule: owns the policy and the frozen reference model, computes the policy loss.

Optimisation is manual: one `training_step` is one optimizer step over a mini-batch of whole
groups, split into micro-batches for memory. Every micro-batch's loss is normalised by the token
and sequence counts of the whole mini-batch, so the gradient does not depend on the micro-batch
size (it would with Lightning's automatic accumulation, which averages micro-batch means).

Precision: `dtype` is the compute dtype, `master_dtype` that of the trainable weights and the
optimizer state (float32 unless the user opts out). bfloat16 compute over float32 weights runs
under Lightning's `bf16-mixed` (autocast), chosen by `loorl.train.trainer_precision`: AdamW
updates at lr 1e-6 are mostly below half a bf16 step of a weight and would round to nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric

from loorl.logprobs import completion_logits, token_entropy, token_logprobs
from loorl.losses import (
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    clipped_surrogate_token_loss,
    kl_per_token,
    reinforce_token_loss,
)
from loorl.models import load_causal_lm
from loorl.rollout.batch import RolloutBatch
from loorl.rollout.engine import SamplingConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KLSettings:
    coef: float = 0.0  # 0 with adaptive=False: no reference model is loaded at all
    in_reward: bool = True  # True: folded into the reward before the baseline; False: a loss term
    estimator: str = "k1"
    adaptive: bool = False
    target: float = 6.0
    horizon: int = 10000

    @property
    def needs_reference(self) -> bool:
        return self.coef > 0 or self.adaptive


@dataclass(frozen=True)
class LossSettings:
    agg: str = "seq-mean-token-sum"
    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio_level: str = "token"
    max_grad_norm: float | None = 1.0
    tis_cap: float | None = None  # truncated importance-sampling cap; None: off
    prompts_per_microbatch: int = 32
    max_len: int = 16  # the generation limit, for seq-mean-token-sum-norm


class PolicyGradientModule(L.LightningModule):
    def __init__(
        self,
        *,
        model_path: str,
        dtype: str = "float32",
        master_dtype: str = "float32",
        ref_dtype: str = "float32",
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        ref_offload: bool = False,
        optimizer,  # a partial: optimizer(params) -> torch.optim.Optimizer
        sampling: SamplingConfig,
        loss: LossSettings,
        kl: KLSettings,
    ) -> None:
        super().__init__()
        self.model_path, self.dtype_name, self.ref_dtype = model_path, dtype, ref_dtype
        self.master_dtype = master_dtype  # the trainable weights' and optimizer state's dtype
        self.attn_implementation = attn_implementation
        self.gradient_checkpointing = gradient_checkpointing
        self.ref_offload = ref_offload  # keep the frozen reference in CPU memory (scored there)
        self.optimizer_factory = optimizer
        self.sampling = sampling  # the trainer scores the sampler's distribution (temperature, top-k/p)
        self.loss_cfg, self.kl = loss, kl
        self.kl_controller = (
            AdaptiveKLController(kl.coef, kl.target, kl.horizon)
            if kl.adaptive
            else FixedKLController(kl.coef)
        )
        self.automatic_optimization = False
        self.strict_loading = False  # the frozen reference is not stored in checkpoints
        self.policy = None
        self.reference = None
        self.val_accuracy = MeanMetric()
        self.val_pass_k = MeanMetric()
        self.reward_mean = MeanMetric()

    # ---- models --------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.policy is not None:  # called again by trainer.fit after trainer.validate
            return
        if self.master_dtype != "float32":
            log.warning(
                "model.master_dtype=%s: the weights and AdamW state are %s, so updates smaller than half "
                "a %s step of a weight are lost (at lr 1e-6 most of them); model.master_dtype=float32 "
                "keeps them",
                self.master_dtype, self.master_dtype, self.master_dtype,
            )  # fmt: skip
        self.policy = load_causal_lm(
            self.model_path, dtype=self.master_dtype, attn_implementation=self.attn_implementation
        )
        if self.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if self.kl.needs_reference:
            reference = load_causal_lm(
                self.model_path,
                dtype=self.ref_dtype,
                attn_implementation=self.attn_implementation,
                trainable=False,
            )
            if self.ref_offload:
                # not registered as a submodule: Lightning leaves it on the CPU, checkpoints skip it
                object.__setattr__(self, "reference", reference)
            else:
                self.reference = reference

    def configure_optimizers(self):
        params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        return self.optimizer_factory(params)

    # ---- training ------------------------------------------------------------------------------
    def on_train_epoch_start(self) -> None:
        dm = self.trainer.datamodule
        if dm is not None and dm.last_rollout is not None:
            rewards = dm.last_rollout.rewards
            self.reward_mean.update(rewards[~rewards.isnan()])
            self.log("rollout/reward", self.reward_mean, on_step=False, on_epoch=True, prog_bar=True)
            self.log_dict(dm.last_stats, on_step=False, on_epoch=True)

    def microbatch_loss(
        self, sub: RolloutBatch, *, num_tokens: float, num_seqs: int
    ) -> tuple[torch.Tensor, dict]:
        """Loss of a micro-batch, normalised by the counts of its whole mini-batch."""
        cfg = self.loss_cfg
        mask = sub.completion_mask  # [n, C]
        logits = completion_logits(self.policy, sub)  # [n, C, V]
        logp = token_logprobs(logits, sub.completion_ids, **self.scoring_kwargs)  # [n, C]
        if sub.old_logprobs is None:  # one optimizer step per rollout: the importance ratio is exactly 1
            tok_loss = reinforce_token_loss(logp, sub.advantages)  # [n, C]
            clipped = torch.zeros_like(mask, dtype=torch.bool)
        else:
            tok_loss, clipped = clipped_surrogate_token_loss(
                logp,
                sub.old_logprobs,
                sub.advantages,
                mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                ratio_level=cfg.ratio_level,
            )
        # Sampler/trainer mismatch: log pi_train - log pi_sampler per token, at the rollout's weights.
        behaviour = (sub.old_logprobs if sub.old_logprobs is not None else logp).detach()  # [n, C]
        log_ratio = torch.where(mask.bool(), behaviour - sub.sampler_logprobs, 0.0)  # [n, C]
        stats = {
            "mismatch_sum": float(log_ratio.sum()),
            "mismatch_max": float(log_ratio.abs().max()) if mask.any() else 0.0,
        }
        if cfg.tis_cap is not None:
            weight = torch.exp(log_ratio).clamp(max=cfg.tis_cap)  # [n, C] truncated IS weight, no gradient
            tok_loss = tok_loss * weight
            stats["tis_weight_sum"] = float((weight * mask).sum())
        if self.reference is not None and not self.kl.in_reward:
            kl_tok = kl_per_token(logp, sub.ref_logprobs, estimator=self.kl.estimator)  # [n, C]
            tok_loss = tok_loss + self.kl_controller.value * kl_tok
            stats["kl_loss_sum"] = float((kl_tok.detach() * mask).sum())
        loss = aggregate(
            tok_loss, mask, mode=cfg.agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=cfg.max_len
        )
        with torch.no_grad():
            entropy = token_entropy(
                logits.detach(), tokens=sub.completion_ids, **self.scoring_kwargs
            )  # [n, C]
            stats["entropy_sum"] = float((entropy * mask).sum())
            stats["clipped_sum"] = float((clipped.float() * mask).sum())
        return loss, stats

    def accumulate_gradients(self, batch: RolloutBatch, backward) -> tuple[float, dict, float]:
        """Backward over the mini-batch in micro-batches of whole groups.

        Returns (loss, stat sums, token count)."""
        mask = batch.completion_mask
        num_tokens = max(float(mask.sum()), 1.0)
        num_seqs = mask.shape[0]
        per_micro = max(1, self.loss_cfg.prompts_per_microbatch)
        total_loss, sums = 0.0, {}
        for start in range(0, batch.num_groups, per_micro):
            sub = batch.select_groups(list(range(start, min(batch.num_groups, start + per_micro))))
            loss, stats = self.microbatch_loss(sub, num_tokens=num_tokens, num_seqs=num_seqs)
            backward(loss)
            total_loss += float(loss.detach())
            for k, v in stats.items():
                sums[k] = max(sums.get(k, 0.0), v) if k.endswith("_max") else sums.get(k, 0.0) + v
        return total_loss, sums, num_tokens

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        t0 = time.perf_counter()
        opt = self.optimizers()
        total_loss, sums, num_tokens = self.accumulate_gradients(batch, self.manual_backward)
        opt.step()  # clips in on_before_optimizer_step, after a 16-mixed loss scaler unscaled the gradients
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        self.log("train/loss", total_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/entropy", sums["entropy_sum"] / num_tokens, on_step=False, on_epoch=True)
        self.log("train/clip_frac", sums["clipped_sum"] / num_tokens, on_step=False, on_epoch=True)
        self.log(
            "train/sampler_logratio_mean", sums["mismatch_sum"] / num_tokens, on_step=False, on_epoch=True
        )
        self.log(
            "train/sampler_logratio_max", sums["mismatch_max"], on_step=False, on_epoch=True, reduce_fx="max"
        )
        if "tis_weight_sum" in sums:
            self.log(
                "train/tis_weight_mean", sums["tis_weight_sum"] / num_tokens, on_step=False, on_epoch=True
            )
        if "kl_loss_sum" in sums:
            self.log("train/kl", sums["kl_loss_sum"] / num_tokens, on_step=False, on_epoch=True)
        self.log(
            "perf/train_tokens_per_s",
            float(batch.attention_mask.sum()) / seconds,
            on_step=False,
            on_epoch=True,
        )
        return torch.tensor(total_loss)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Gradient-norm clipping, where Lightning has already unscaled fp16 gradients."""
        if self.loss_cfg.max_grad_norm:
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.policy.parameters() if p.grad is not None], self.loss_cfg.max_grad_norm
            )
            self.log("train/grad_norm", float(grad_norm), on_step=True, on_epoch=False)

    @property
    def scoring_kwargs(self) -> dict:
        """The sampler's temperature and truncation, for every log-prob and entropy of the policy."""
        s = self.sampling
        return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}

    # ---- held-out evaluation -------------------------------------------------------------------
    def validation_step(self, prompts, batch_idx: int) -> None:
        correct, pass_k = self.trainer.datamodule.evaluate(self.policy, prompts)
        self.val_accuracy.update(correct)
        self.log("val/accuracy", self.val_accuracy, on_step=False, on_epoch=True, prog_bar=True)
        if pass_k is not None:
            self.val_pass_k.update(pass_k)
            self.log("val/pass_at_k", self.val_pass_k, on_step=False, on_epoch=True)

    # ---- checkpoints ---------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("reference.")
        }
        checkpoint["kl_controller"] = self.kl_controller.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "kl_controller" in checkpoint:
            self.kl_controller.load_state_dict(checkpoint["kl_controller"])
