"""Per-token log-probabilities of a rollout's completions under a model (policy, reference, old policy)."""

from __future__ import annotations

import torch

from loorl.losses import token_logprobs
from loorl.rollout.batch import RolloutBatch
from loorl.rollout.engine import SamplingConfig


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
    model, batch: RolloutBatch, *, sampling: SamplingConfig, groups_per_pass: int | None = None
) -> torch.Tensor:
    """log pi(y_t | x, y_<t) [N, C] under the sampler's distribution (temperature, top-k, top-p).

    The model runs on `groups_per_pass` whole groups at a time (all at once when None), so the
    [n, C, V] logits of only one pass are alive: a whole rollout's logits are the memory peak with
    large vocabularies (512 x 513 x 152k bf16 logits are 80 GB). Padding positions are garbage.
    """
    step = batch.num_groups if groups_per_pass is None else max(1, groups_per_pass)
    parts = []
    for start in range(0, batch.num_groups, step):
        sub = (
            batch
            if step >= batch.num_groups
            else batch.select_groups(list(range(start, min(batch.num_groups, start + step))))
        )
        logits = completion_logits(model, sub)  # [n, C, V]
        parts.append(
            token_logprobs(
                logits,
                sub.completion_ids,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
            )  # [n, C]
        )
        del logits
    return torch.cat(parts)  # [N, C]
