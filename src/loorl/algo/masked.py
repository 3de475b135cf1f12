"""Statistics over the entries a boolean mask selects (advantages, losses and rollout statistics).

Entries outside the mask may hold anything, even NaN: they are replaced before any sum with
`torch.where`, never multiplied by 0 (NaN * 0 is NaN).
"""

from __future__ import annotations

import torch


def _sum(x: torch.Tensor, dim: int | None, keepdim: bool) -> torch.Tensor:
    if dim is None:
        total = x.sum()  # []
        return total.reshape([1] * x.dim()) if keepdim else total
    return x.sum(dim=dim, keepdim=keepdim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *, keepdim: bool = False
) -> torch.Tensor:
    """Mean of x over the entries where mask is true; 0 where there are none.

    Entries outside the mask may hold NaN: they are replaced before summing, never multiplied.
    """
    mask = mask.bool()  # like x
    count = _sum(mask.to(x.dtype), dim, keepdim)  # reduced shape
    total = _sum(torch.where(mask, x, 0.0), dim, keepdim)  # reduced shape
    return total / count.clamp(min=1)  # reduced shape


def masked_std(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    *,
    keepdim: bool = False,
    unbiased: bool = True,
) -> torch.Tensor:
    """Standard deviation over the masked entries (Bessel-corrected like torch.std by default).

    0 where fewer than 2 (unbiased) or 1 (biased) entries are masked in, instead of NaN.
    """
    mask = mask.bool()  # like x
    count = _sum(mask.to(x.dtype), dim, True)  # dims kept
    mean = masked_mean(x, mask, dim, keepdim=True)  # dims kept
    dev = torch.where(mask, x - mean, 0.0)  # like x
    denom = count - 1 if unbiased else count  # dims kept
    var = _sum(dev * dev, dim, True) / denom.clamp(min=1)  # dims kept
    std = torch.where(denom > 0, var.sqrt(), 0.0)  # dims kept
    if not keepdim:
        std = std.reshape(()) if dim is None else std.squeeze(dim)  # reduced shape
    return std


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over all masked entries of x; 0 outside the mask."""
    mask = mask.bool()  # like x
    mean = masked_mean(x, mask)  # []
    std = masked_std(x, mask)  # []
    return torch.where(mask, (x - mean) / (std + eps), 0.0)  # like x
