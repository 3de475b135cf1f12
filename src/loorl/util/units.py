"""The one unit of memory: every figure a user reads (summary, logs, plan, docs) is in GiB."""

from __future__ import annotations

GiB = 2**30


def gib_to_bytes(gib: float) -> int:
    """A GiB setting (`kv_cache_memory_gib=2.5`) as the whole bytes vLLM's `kv_cache_memory_bytes` takes."""
    return int(gib * GiB)
