"""Autocast with its weight-cast cache on, inside Lightning's autocast (which turns the cache off).

Under `bf16-mixed` Lightning runs the step in `torch.autocast(..., cache_enabled=False)`, so every
use of a float32 weight casts it to bf16 anew: at every decoding step of a rollout (SmolLM2: 24
steps x 135M weights, ~1.2 s of a 4.4 s rollout), and once per forward call in training, where a
shared-prompt forward makes two calls and autograd keeps both bf16 copies for the backward (270 MB
each for SmolLM2). Inside `cached_autocast` each weight is cast once. The cache is emptied when the
block ends, so nothing cast before an optimizer step is used after it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def cached_autocast(device: torch.device):
    """Under autocast, the same autocast with its cast cache on for the block; else nothing."""
    if not torch.is_autocast_enabled(device.type):
        yield
        return
    try:
        with torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=True):
            yield
    finally:
        torch.clear_autocast_cache()
