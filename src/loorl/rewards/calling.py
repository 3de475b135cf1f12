"""Calling a reward function: TRL's signature with the prompts' other columns (their `meta`) and, to a
function that takes them, each sample's tool calls; every value a float, NaN where it is None, not a
number or not finite; a batch that raises is called again one sample at a time, so that one bad sample
does not take its whole batch down."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

from loorl.types import Prompt

RewardFn = Callable[..., Sequence[float | None]]


def takes_tool_calls(fn: RewardFn) -> bool:
    """Whether a reward function takes `tool_calls`: by name, or through `**kwargs`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return any(p.name == "tool_calls" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def finite_or_nan(value) -> float:
    """A reward as a float: NaN where it is None, not a number, or not finite (unscorable)."""
    try:
        value = float("nan") if value is None else float(value)
    except (TypeError, ValueError):
        return float("nan")
    return value if math.isfinite(value) else float("nan")


def _call(fn: RewardFn, prompts: list[Prompt], completions: list[str], tool_calls=None) -> list[float]:
    columns: dict[str, list] = {}
    for key in sorted({k for p in prompts for k in p.meta}):
        columns[key] = [p.meta.get(key) for p in prompts]
    if tool_calls is not None and takes_tool_calls(fn):
        columns["tool_calls"] = [list(calls) for calls in tool_calls]
    out = list(fn(prompts=[p.text for p in prompts], completions=completions, **columns))
    if len(out) != len(completions):
        raise ValueError(f"returned {len(out)} rewards for {len(completions)} completions")
    return [finite_or_nan(v) for v in out]


def call_isolated(
    fn: RewardFn, prompts: list[Prompt], completions: list[str], tool_calls=None
) -> tuple[list[float], Exception | None]:
    """Rewards of a batch, NaN where unscorable; on a raising batch, retry sample by sample."""
    try:
        return _call(fn, prompts, completions, tool_calls), None
    except Exception as err:  # noqa: BLE001 - user reward code may raise anything
        first = err
    values = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        try:
            values.append(_call(fn, [p], [c], None if tool_calls is None else [tool_calls[i]])[0])
        except Exception:  # noqa: BLE001
            values.append(float("nan"))
    return values, first
