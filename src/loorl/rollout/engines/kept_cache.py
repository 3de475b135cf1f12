"""A decoding call's key/value cache, kept for its rows' next turn (multi-turn rollouts with tools).

Without it, each turn of the HF engine prefills the whole transcript again: the prompt, every
earlier turn and the tool's results. For SmolLM2 on 2 cores, 32 rows x 140 tokens took 13 s of a
25-30 s step. Kept, a turn feeds only what the cache lacks: the row's last sampled id (the loop
stops before feeding it) and the result ids.

A batch's rows share the cache's columns, so a row's own ids leave holes:
- the left padding of the prompts;
- the padding decoded after the row ended while others went on;
- the left padding of the next turn's chunks.

`mask` [b, T] marks the columns that hold the row's ids, and attention reads only those.
`positions` [b] is where the row's next id goes (the count of its ids), so each id gets the position
and keys a re-prefill would give it. transformers builds the attention from a 2-D mask with holes
and the cache's column index (causality), so the model needs no change.

Only the dynamic (growing) cache keeps (`HFEngine.continues_turns`); static and compiled decoding
prefill each turn again.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from loorl.types import Completion


@dataclass
class KeptRows:
    """One decoding call's cache after it returned, for its rows' next turn."""

    cache: object  # transformers' DynamicCache over the call's b rows and T columns
    mask: torch.Tensor  # [b, T] 1 on the columns that hold one of the row's ids
    positions: torch.Tensor  # [b] each row's next position: how many ids of its own the cache holds
    known: list[list[int]]  # [b] those ids, in order (the prompt's, then the turns')


@dataclass(frozen=True)
class KeptRow:
    """A handle on one row of a `KeptRows`: what a sample keeps between its turns."""

    rows: KeptRows
    index: int


@dataclass
class Continuation:
    """The rows of one `KeptRows` that a turn continues, with what the cache lacks of each."""

    requests: list[int]  # the rows' places in the turn's request
    cache: object  # their rows of the cache (a copy: the kept one may serve another turn's rows)
    mask: torch.Tensor  # [m, T]
    positions: torch.Tensor  # [m]
    chunks: list[list[int]]  # [m] each transcript's ids after the row's known ones (never empty)


def kept_after_turn(
    cache, mask: torch.Tensor, prompts: list[list[int]], completions: list[Completion], steps: int
) -> KeptRows:
    """What `cache` holds of each row after a decoding call of `steps` tokens over `prompts`.

    The loop fed every token but the last (`decode_steps`), so the cache holds a row's first
    min(len, steps - 1) completion ids; the columns after a row ended (padding it went on decoding)
    are masked out. `mask` [b, T]: the call's mask, T = the prompts' padded length + steps - 1."""
    mask = mask.clone()  # [b, T]
    start = mask.shape[1] - (steps - 1)  # the first completion column
    fed = [min(len(c.token_ids), steps - 1) for c in completions]  # [b]
    for row, count in enumerate(fed):
        mask[row, start + count :] = 0
    known = [list(p) + list(c.token_ids[:count]) for p, c, count in zip(prompts, completions, fed)]
    return KeptRows(cache, mask, mask.sum(-1), known)


def continuations(handles: list[KeptRow | None], transcripts: list[list[int]]) -> list[Continuation] | None:
    """The turn's rows grouped by the call that kept them, in first-seen order; None when some row
    cannot continue from its cache (no handle, a cache `select_rows` cannot copy, a transcript that
    does not extend the ids the cache holds or adds nothing to them): the caller prefills them all."""
    groups: dict[int, tuple[KeptRows, list[int]]] = {}
    for place, (handle, ids) in enumerate(zip(handles, transcripts)):
        if handle is None:
            return None
        known = handle.rows.known[handle.index]
        if not keeps(handle.rows.cache) or len(ids) <= len(known) or ids[: len(known)] != known:
            return None
        groups.setdefault(id(handle.rows), (handle.rows, []))[1].append(place)
    parts = []
    for kept, places in groups.values():
        rows = [handles[p].index for p in places]
        parts.append(
            Continuation(
                requests=places,
                cache=select_rows(kept.cache, rows),
                mask=kept.mask[rows],
                positions=kept.positions[rows],
                chunks=[transcripts[p][len(kept.known[handles[p].index]) :] for p in places],
            )
        )
    return parts


def select_rows(cache, rows: list[int]):
    """A new cache of `rows` of `cache`, which is left as it was (transformers' `batch_select_indices`
    changes the cache in place, and a kept call may serve two of a turn's calls: the rows that may
    still call a tool and those that may not)."""
    index = torch.tensor(rows, device=cache.layers[0].keys.device)
    selected = copy.copy(cache)
    selected.layers = []
    for layer in cache.layers:
        part = copy.copy(layer)
        part.keys, part.values = layer.keys[index], layer.values[index]  # [m, heads, T, d]
        selected.layers.append(part)
    return selected


def keeps(cache) -> bool:
    """Whether the rows of `cache` can be kept and selected: every layer a plain growing one (a
    sliding-window or static layer holds state that `select_rows` does not carry)."""
    from transformers.cache_utils import DynamicLayer

    from loorl.rollout.engines.kv_cache import compute_dtype_dynamic_layer

    growing = (DynamicLayer, compute_dtype_dynamic_layer())
    return all(type(layer) in growing for layer in getattr(cache, "layers", [None]))
