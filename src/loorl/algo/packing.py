"""Padding-free micro-batches: a rollout's rows packed into one sequence of real tokens each.

A padded micro-batch [n, P + C] computes on every pad position; packed, the n rows' real tokens
stand one after another in a single row [1, T] (T = their real tokens), each sequence with its own
positions (0, 1, ...) and an attention that never crosses sequences. With `share_prompt`, a group's
prompt stands once, followed by its K completions, each of which sees the prompt and itself only:
the prompt's key/value states are computed once for the group, as `shared_prompt_logits` does for
padded batches. The rows of a step are planned into micro-batches of at most a token budget
(`rl.microbatch_tokens`), so a step's memory follows a setting, not how long the answers were.

transformers runs a packed row when it is given the attention as a 4-D boolean mask [1, 1, T, T]
(sdpa; eager gets the additive form), or, for flash-attention's variable-length kernels, no mask and
position ids that restart at 0 (its own packed-sequence path; the shared prompt needs the mask, so
it is not shared there). Flash-attention was not available on the machines that wrote this: untested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loorl.types import RolloutBatch


def plan_microbatches(costs: list[int], budget: int) -> list[list[int]]:
    """Units (rows or groups) into micro-batches of at most `budget` tokens each, first-fit
    decreasing (the longest first, each into the first micro-batch it fits). A unit longer than the
    budget gets a micro-batch of its own. Deterministic; each micro-batch lists its units in order."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for unit in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        for b, load in enumerate(loads):
            if load + costs[unit] <= budget:
                bins[b].append(unit)
                loads[b] += costs[unit]
                break
        else:
            bins.append([unit])
            loads.append(costs[unit])
    return [sorted(b) for b in bins]


def unit_costs(batch: RolloutBatch, *, share_prompt: bool) -> list[int]:
    """The real tokens each packing unit puts in a micro-batch: a row's prompt and completion, or
    with `share_prompt` a group's prompt once and its K completions."""
    real = batch.attention_mask.sum(-1)  # [N]
    if not share_prompt:
        return real.tolist()
    k, p_len = batch.samples_per_prompt, batch.prompt_len
    prompt = batch.attention_mask[::k, :p_len].sum(-1)  # [G]
    completions = batch.attention_mask[:, p_len:].sum(-1).view(-1, k).sum(-1)  # [G]
    return (prompt + completions).tolist()


@dataclass
class PackedRows:
    """One packed row of a micro-batch and where its scored positions come from and go to."""

    input_ids: torch.Tensor  # [1, T] real tokens only
    position_ids: torch.Tensor  # [1, T] from 0 in each sequence
    sequence: torch.Tensor  # [T] the row (or, for a shared prompt, -1 - group) each token belongs to
    group: torch.Tensor  # [T] the group of each token
    scored: torch.Tensor  # [M] positions in the packed row whose next-token distribution is scored
    targets: torch.Tensor  # [M] the completion token each predicts
    where: torch.Tensor  # [N, C] bool: the completion positions the M scores fill, row-major


def pack(batch: RolloutBatch, *, share_prompt: bool) -> PackedRows:
    """The batch's rows (left-padded prompts, right-padded completions) as one packed row."""
    n, p_len = batch.input_ids.shape[0], batch.prompt_len
    k = batch.samples_per_prompt
    device = batch.input_ids.device
    mask = batch.attention_mask.bool()  # [N, P + C]
    prompt_real, completion_real = mask[:, :p_len], mask[:, p_len:]  # [N, P], [N, C]
    rows = torch.arange(n, device=device)
    if share_prompt and k > 1:
        # per group: the prompt of its first row, then every row's completion
        prompt_rows = torch.zeros_like(mask)  # [N, P + C] which entries enter the packed row
        prompt_rows[::k, :p_len] = prompt_real[::k]
        keep = prompt_rows.clone()
        keep[:, p_len:] = completion_real
        # order: group-major, the prompt first, then the K completions in row order
        order_key = torch.zeros_like(batch.input_ids)  # [N, P + C]
        group_of_row = rows // k  # [N]
        cols = torch.arange(mask.shape[1], device=device)
        is_prompt = cols < p_len  # [P + C]
        order_key = (
            group_of_row[:, None] * (k + 1) * mask.shape[1]
            + torch.where(is_prompt, 0, (rows % k + 1)[:, None] * mask.shape[1])
            + cols
        )  # [N, P + C] a unique sort key in the packed order
        flat_keys = order_key[keep]  # [T] in row-major order
        order = flat_keys.argsort()
        ids = batch.input_ids[keep][order]  # [T]
        positions = batch.position_ids[keep][order]  # [T] completions continue their prompt's positions
        sequence = torch.where(is_prompt[None], -1 - group_of_row[:, None], rows[:, None])[keep][order]
        group = group_of_row[:, None].expand_as(mask)[keep][order]  # [T]
        flat_index = torch.empty_like(order)
        flat_index[order] = torch.arange(len(order), device=device)  # row-major keep index -> packed
        index = torch.full(mask.shape, -1, dtype=torch.long, device=device)  # [N, P + C]
        index[keep] = flat_index
        # a group's last prompt token predicts every one of its rows' first completion token
        last_prompt = index[::k, p_len - 1].repeat_interleave(k)  # [N]
        index[:, p_len - 1] = last_prompt
    else:
        ids, positions = batch.input_ids[mask], batch.position_ids[mask]  # [T]
        sequence = rows[:, None].expand_as(mask)[mask]  # [T]
        group = (rows // k)[:, None].expand_as(mask)[mask]  # [T]
        index = torch.full(mask.shape, -1, dtype=torch.long, device=device)  # [N, P + C]
        index[mask] = torch.arange(int(mask.sum()), device=device)
    # completion token j of a row is predicted at the packed position of the token before it
    predictor = index[:, p_len - 1 : -1]  # [N, C] the position before each completion column
    where = completion_real & (predictor >= 0)  # [N, C]
    return PackedRows(
        input_ids=ids[None],
        position_ids=positions[None],
        sequence=sequence,
        group=group,
        scored=predictor[where],
        targets=batch.completion_ids[where],
        where=where,
    )


def packed_attention_mask(
    packed: PackedRows, *, implementation: str, dtype: torch.dtype
) -> torch.Tensor | None:
    """The attention of a packed row [1, 1, T, T]: causal, within a sequence, and a completion also
    sees its group's shared prompt. None for flash-attention (it reads the sequences from the
    position ids). `eager` adds the mask to the scores: 0 where allowed, the dtype's minimum elsewhere."""
    if implementation.startswith("flash"):
        return None
    t = packed.sequence.shape[0]
    seq, grp = packed.sequence, packed.group  # [T]
    causal = torch.ones(t, t, dtype=torch.bool, device=seq.device).tril_()  # [T, T] key <= query
    same = (seq[:, None] == seq[None, :]) | ((seq[None, :] < 0) & (grp[:, None] == grp[None, :]))  # [T, T]
    allowed = (causal & same)[None, None]  # [1, 1, T, T]
    if implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=seq.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
    return allowed
