"""Per-token log-probabilities of a rollout's completions under a model (policy, reference, old policy)."""

from __future__ import annotations

import torch

from loorl.losses import token_logprobs
from loorl.rollout.batch import RolloutBatch


def completion_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """Logits at the positions that predict each completion token.

    Position ids come from the attention mask: with left padding, the default 0..L-1 positions
    would differ from those the sampler used. Only the last C+1 positions' logits are computed.
    """
    c_len = batch.completion_ids.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=c_len + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]  # [N, C, V]


def completion_logprobs(
    model, batch: RolloutBatch, *, temperature: float, chunk: int | None = None
) -> torch.Tensor:
    """log pi(y_t | x, y_<t) of the temperature-scaled distribution, [N, C]; padding positions are garbage."""
    if chunk is None or chunk >= batch.input_ids.shape[0]:
        return token_logprobs(completion_logits(model, batch), batch.completion_ids, temperature=temperature)
    parts = []
    for start in range(0, batch.num_groups, max(1, chunk // batch.group_size)):
        groups = list(range(start, min(batch.num_groups, start + max(1, chunk // batch.group_size))))
        sub = batch.select_groups(groups)
        parts.append(
            token_logprobs(completion_logits(model, sub), sub.completion_ids, temperature=temperature)
        )
    return torch.cat(parts)  # [N, C]
