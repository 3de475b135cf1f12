"""Small reward functions with TRL's signature, usable from `conf/reward/*.yaml`."""

from __future__ import annotations


def length_penalty(
    prompts: list[str], completions: list[str], *, target_chars: int = 200, **_
) -> list[float]:
    """0 up to `target_chars` characters, then -1 per extra `target_chars` characters (linear)."""
    return [-max(0, len(c) - target_chars) / target_chars for c in completions]


def format_reward(prompts: list[str], completions: list[str], *, marker: str = "####", **_) -> list[float]:
    """1 when the completion contains the answer marker (GSM8K's `####`), else 0."""
    return [float(marker in c) for c in completions]
