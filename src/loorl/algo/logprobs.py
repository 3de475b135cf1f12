"""Log-probabilities and entropies of completion tokens under the sampler's distribution, from a
model's passes over a rollout batch (padded or packed, the logits or the chunked output layer).

The distribution itself (temperature, top-k / top-p) is `loorl.algo.distribution`'s; its functions
are imported here too, where most callers look for them.
Shapes: N sequences, T (or C) completion positions, V vocabulary entries.
"""

from __future__ import annotations

import torch

from loorl.algo.distribution import (  # noqa: F401  (re-exported: callers import them from here)
    _check_temperature,
    _upcast,
    filter_logits,
    token_entropy,
    token_logprobs,
)
from loorl.algo.head_logprobs import DEFAULT_CHUNK_TOKENS, output_layer, scoring_head
from loorl.algo.packing import pack, packed_attention_mask, plan_microbatches, unit_costs
from loorl.types import RolloutBatch, SamplingConfig
from loorl.util.hf_compat import activation_checkpointing, with_cache


# ---- a model's log-probs of a rollout's completions ------------------------------------------------
def completion_logits(model, batch: RolloutBatch, *, share_prompt: bool = False, head=None) -> torch.Tensor:
    """Logits [N, C, V] at the positions that predict each completion token.

    Position ids come from the attention mask: with left padding, the default 0..L-1 positions
    would differ from those the sampler used. Only the C positions that predict a completion token
    reach the output layer. `share_prompt`: each group's prompt runs once (`shared_prompt_logits`),
    same values and gradients. `head`: a `head_logprobs.ScoringHead` standing in for the output
    layer; the result is then its log-probs [N, C] of the completion tokens.
    """
    if share_prompt and can_share_prompt(model, batch):
        return shared_prompt_logits(model, batch, head=head)
    length, c_len = batch.input_ids.shape[1], batch.completion_ids.shape[1]
    if head is not None:
        head.targets, head.repeat = batch.completion_ids, 1
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=torch.arange(length - c_len - 1, length - 1, device=batch.input_ids.device),  # [C]
        use_cache=False,
    )
    return out.logits  # [N, C, V] (or [N, C] log-probs through `head`)


def can_share_prompt(model, batch: RolloutBatch) -> bool:
    """Groups of more than one row, a prompt to share, and a model whose forward keeps its key/value
    cache (transformers turns the cache off under gradient checkpointing in training mode)."""
    checkpointing = activation_checkpointing(model) and model.training
    return batch.samples_per_prompt > 1 and batch.prompt_len > 0 and not checkpointing


def shared_prompt_logits(model, batch: RolloutBatch, *, head=None) -> torch.Tensor:
    """`completion_logits` with each group's prompt run once instead of K times.

    The K rows of a group hold the same left-padded prompt (`rollout.batch.assemble`), so its
    key/value states are the same in every row: the prompt runs once per group, its cache is
    repeated K times, and the completions run on top of it. The logits equal the full forward's
    up to float rounding, and so do the gradients: they flow through the repeated cache into the
    one prompt pass (summed over the K rows, as the full forward sums them). The forward then
    costs G*P + N*C tokens instead of N*(P + C); with K=4 and prompts twice the completions'
    length, 2.5x fewer. Written here because transformers shares a prefix only at generation.
    """
    from transformers import DynamicCache

    k, p_len = batch.samples_per_prompt, batch.prompt_len
    positions = batch.position_ids  # [N, P + C]
    cache = DynamicCache(config=model.config)
    if head is not None:  # the prompt's last state, repeated K times, predicts each row's first token
        head.targets, head.repeat = batch.completion_ids[:, :1], k
    prompt = model(
        input_ids=batch.input_ids[::k, :p_len],  # [G, P] one row per group
        attention_mask=batch.attention_mask[::k, :p_len],
        position_ids=positions[::k, :p_len],
        **with_cache(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    first = prompt.logits if head is not None else prompt.logits.repeat_interleave(k, dim=0)  # [N, 1, ...]
    if batch.input_ids.shape[1] - p_len == 1:
        return first
    cache.batch_repeat_interleave(k)  # [G, ...] -> [N, ...], differentiable
    if head is not None:
        head.targets, head.repeat = batch.completion_ids[:, 1:], 1
    rest = model(
        input_ids=batch.input_ids[:, p_len:-1],  # [N, C-1] completion tokens 0..C-2
        attention_mask=batch.attention_mask[:, :-1],  # [N, P + C-1] the prompt, then the completion
        position_ids=positions[:, p_len:-1],
        **with_cache(cache),
        use_cache=True,
    )
    return torch.cat([first, rest.logits], dim=1)  # [N, C, V] (or [N, C])


def packed_completion_logprobs(model, batch: RolloutBatch, *, share_prompt: bool, head) -> torch.Tensor:
    """log pi [N, C] of the completions with the rows packed into one padding-free row
    (`loorl.algo.packing`); 0 at padding. `head`: the `ScoringHead` in the model's output layer."""
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    share = share_prompt and batch.samples_per_prompt > 1 and not implementation.startswith("flash")
    packed = pack(batch, share_prompt=share)
    dtype = next(model.parameters()).dtype
    mask = packed_attention_mask(packed, implementation=implementation, dtype=dtype)  # [1, 1, T, T]
    head.targets, head.repeat = packed.targets[None], 1  # [1, M]
    out = model(
        input_ids=packed.input_ids,  # [1, T]
        attention_mask=mask,
        position_ids=packed.position_ids,  # [1, T]
        logits_to_keep=packed.scored,  # [M]
        use_cache=False,
    )
    logp = out.logits.new_zeros(packed.where.shape)  # [N, C]
    logp[packed.where] = out.logits[0]  # [M] -> their completion positions
    head.entropies[-1] = _unpack(head.entropies[-1][0], packed.where)  # [N, C]
    return logp


def _unpack(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    out = values.new_zeros(where.shape)  # [N, C]
    out[where] = values
    return out


def completion_scores(
    model,
    batch: RolloutBatch,
    *,
    sampling: SamplingConfig,
    share_prompt: bool = False,
    packed: bool = False,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) [N, C] under the sampler's distribution, and its entropy [N, C] (None
    unless `with_entropy`; with a gradient where `entropy_grad`, for an entropy term in the loss).
    Padding positions are garbage.

    Where the model's output layer is a plain linear layer, the log-probs come from its hidden
    states chunk by chunk (`head_logprobs`: no [N, C, V] logits, also in the backward); elsewhere
    (a LoRA-wrapped output layer, say) from the logits. `packed`: the rows run as one padding-free
    sequence (`loorl.algo.packing`; needs the chunked path).
    """
    score = sampling.score_args
    if output_layer(model) is None:
        logits = completion_logits(model, batch, share_prompt=share_prompt)  # [N, C, V]
        logp = token_logprobs(logits, batch.completion_ids, **score)  # [N, C]
        if not with_entropy:
            return logp, None
        if entropy_grad:  # keeps [n, C, V] temporaries for the backward: the chunked head's path does not
            return logp, token_entropy(logits, tokens=batch.completion_ids, **score)  # [N, C]
        with torch.no_grad():
            return logp, token_entropy(logits.detach(), tokens=batch.completion_ids, **score)  # [N, C]
    chunk = chunk_tokens or DEFAULT_CHUNK_TOKENS
    with scoring_head(
        model, sampling_args=score, chunk_tokens=chunk, with_entropy=with_entropy, entropy_grad=entropy_grad
    ) as head:
        if packed:
            logp = packed_completion_logprobs(model, batch, share_prompt=share_prompt, head=head)  # [N, C]
        else:
            logp = completion_logits(model, batch, share_prompt=share_prompt, head=head)  # [N, C]
    entropy = torch.cat(head.entropies, dim=1) if with_entropy else None  # [N, C]
    return logp, entropy


def completion_logprobs(
    model,
    batch: RolloutBatch,
    *,
    sampling: SamplingConfig,
    groups_per_pass: int | None = None,
    share_prompt: bool = False,
    microbatch_tokens: int | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """log pi(y_t | x, y_<t) [N, C] under the sampler's distribution (temperature, top-k, top-p).

    The model runs on `groups_per_pass` whole groups at a time (all at once when None), or, with
    `microbatch_tokens`, on packed micro-batches of at most that many real tokens
    (`loorl.algo.packing`), so only one pass's activations are alive. Padding positions are garbage.
    `share_prompt`: see `shared_prompt_logits`.
    """
    args = {"sampling": sampling, "share_prompt": share_prompt, "chunk_tokens": chunk_tokens}
    if microbatch_tokens is None:
        parts = [completion_scores(model, sub, **args)[0] for sub in batch.group_chunks(groups_per_pass)]
        return torch.cat(parts)  # [N, C]
    out = torch.zeros(batch.completion_mask.shape, device=batch.input_ids.device)  # [N, C]
    for rows in microbatch_rows(batch, microbatch_tokens, share_prompt=share_prompt):
        out[rows] = completion_scores(model, batch.select_rows(rows), packed=True, **args)[0].to(out.dtype)
    return out  # [N, C]


def microbatch_rows(batch: RolloutBatch, budget: int, *, share_prompt: bool) -> list[torch.Tensor]:
    """The rows [n] of each packed micro-batch of at most `budget` real tokens; with `share_prompt`
    a group's rows stay together (its prompt is packed once)."""
    share = share_prompt and batch.samples_per_prompt > 1
    k = batch.samples_per_prompt if share else 1
    plans = plan_microbatches(unit_costs(batch, share_prompt=share), budget)
    return [torch.tensor([u * k + i for u in units for i in range(k)], dtype=torch.long) for units in plans]


class FrozenReference:
    """The frozen reference policy, kept outside the LightningModule's tree of submodules.

    Lightning then neither wraps, moves nor checkpoints it: it is rebuilt from the model files,
    lives on the training device, or in CPU memory with `offload` (scored there, results moved back).
    """

    # False: the KL takes the policy's log-probs from the sampler where they match the trainer's; True:
    # from a no-grad pass of the trainer's own (a reference that is the policy with its adapters off,
    # `loorl.models.lora.AdapterFreeReference`, then differs from it by the adapters alone)
    kl_from_policy_pass: bool = False

    def __init__(self, model, *, offload: bool = False) -> None:
        self.model, self.offload = model, offload

    def parameters(self):
        return self.model.parameters()

    def completion_logprobs(self, batch, *, device: torch.device, **score) -> torch.Tensor:
        """log ref(y_t | ...) [N, C] of the batch's completions (see `logprobs.completion_logprobs`)."""
        from loorl.algo.logprobs import completion_logprobs
        from loorl.parallel.fsdp import is_sharded

        target = torch.device("cpu") if self.offload else torch.device(device)
        if not is_sharded(self.model) and next(self.model.parameters()).device != target:
            self.model.to(target)  # (a sharded reference stays where FSDP placed it)
        return completion_logprobs(self.model, batch.to(target), **score).to(device)  # [N, C]
