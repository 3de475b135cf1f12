"""How one RL step's rollout is cut for the optimizer: mini-batches of whole groups (one optimizer step
each) and, inside one, the micro-batches that one forward and backward take."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from loorl.algo.logprobs import microbatch_rows
from loorl.settings import RLSettings
from loorl.types import RolloutBatch


def minibatch_prompts(rl: RLSettings, *, seed: int, step: int, world_size: int = 1) -> list[list[int]]:
    """This rank's groups in each optimizer step of RL step `step`, as indices into its own B/W groups.

    Every group once per pass, shuffled per pass by a generator seeded with (seed, step), so a
    resumed run takes the same mini-batches. With W ranks each takes M/W of its own groups into
    every mini-batch: the global mini-batch is M whole groups, and no group crosses ranks.
    """
    groups, per_step = rl.prompts_per_step // world_size, rl.prompts_per_minibatch // world_size
    gen = torch.Generator().manual_seed(int(np.random.default_rng([seed, step, 1]).integers(2**62)))
    out = []
    for _ in range(rl.epochs_per_rollout):
        order = torch.randperm(groups, generator=gen).tolist()
        out += [order[i : i + per_step] for i in range(0, len(order), per_step)]
    return out


def microbatches(batch: RolloutBatch, rl: RLSettings, *, skip_zero_advantage: bool) -> Iterator[RolloutBatch]:
    """The pieces of a mini-batch that one forward and backward take: `rl.prompts_per_microbatch`
    whole groups (padded), or with `rl.microbatch_tokens` packed micro-batches of at most that
    many real tokens (advantages are already computed, so rows of a group may be apart, unless
    `share_prompt` packs their prompt once). `skip_zero_advantage`: groups whose advantages are
    all 0 are left out first; the loss's counts are the whole mini-batch's, so the loss and the
    gradient stay the same."""
    budget = rl.microbatch_tokens
    if budget is None:
        for sub in batch.group_chunks(rl.prompts_per_microbatch):
            keep = sub.groups_with_signal() if skip_zero_advantage else None
            yield sub if keep is None or len(keep) == sub.num_groups else sub.select_groups(keep)
        return
    if skip_zero_advantage:
        keep = batch.groups_with_signal()
        batch = batch if len(keep) == batch.num_groups else batch.select_groups(keep)
    for rows in microbatch_rows(batch, budget, share_prompt=rl.share_prompt):
        yield batch.select_rows(rows)
