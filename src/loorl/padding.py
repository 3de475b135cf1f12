"""Padding ragged token lists into rectangular tensors: the one helper for prompts, completions and
warm-start examples (the tokenizer's `pad` works on encodings, not on generated id lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch


def pad(
    rows: Sequence[Sequence[int | float]],
    *,
    value: int | float,
    side: Literal["left", "right"],
    width: int | None = None,
    dtype: torch.dtype = torch.long,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded with `value` to `width` (default: the longest row) on `side`.

    Returns the values [n, width] and a long mask [n, width] that is 1 on the rows' own entries.
    """
    width = max((len(r) for r in rows), default=0) if width is None else width
    values = torch.full((len(rows), width), value, dtype=dtype)  # [n, W]
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [n, W]
    for i, row in enumerate(rows):
        if not len(row):
            continue
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        values[i, cols] = torch.tensor(row, dtype=dtype)
        mask[i, cols] = 1
    return values, mask
