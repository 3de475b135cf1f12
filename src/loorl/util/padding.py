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
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)  # [n]
    width = int(lengths.max()) if width is None and len(rows) else (width or 0)
    values = torch.full((len(rows), width), value, dtype=dtype)  # [n, W]
    cols = torch.arange(width).expand(len(rows), width)  # [n, W]
    start = width - lengths if side == "left" else torch.zeros_like(lengths)  # [n] first own column
    mask = ((cols >= start[:, None]) & (cols < (start + lengths)[:, None])).long()  # [n, W]
    flat = [v for r in rows for v in r]  # one tensor from all rows (a tensor per row is the slow part)
    if flat:
        values[mask.bool()] = torch.tensor(flat, dtype=dtype)  # row-major order = each row's own order
    return values, mask
