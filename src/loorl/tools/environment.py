"""Environments written to TRL's `environment_factory` contract, run in loorl's multi-turn rollouts
(`environment._target_`, docs/how-to/environments.md).

The contract (TRL's `GRPOTrainer(environment_factory=...)`): a class with a no-argument constructor;
`reset(**row) -> str | None`, called with the prompt row's fields before the sample is generated;
its public methods (not `_`-prefixed, not `reset` or `get_reward`) are the tools, described by their
docstrings and type hints (`transformers.utils.get_json_schema`); an optional `get_reward() -> float`
scores the finished sample. loorl builds one instance per sample (a prompt's K samples each get
their own) and calls all of it through `run_call`'s time and size limits.

The call format is the Hermes/Qwen one, fixed: the policy writes
`<tool_call>{"name": "fn", "arguments": {...}}</tool_call>`; the engine stops the turn on the closing
tag, the JSON is parsed and checked against the method's schema (the name is one of the tools; the
arguments are a JSON object with every required one, no other, each of its hinted type), and only
then is the method called. Anything else is an error result the policy reads (`error: ...`), never a
call. The result goes into the transcript as the other tools' do (`tools.result_format`, or the
chat template's tool message under `tools.insert`).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from typing import Any

from loorl.errors import ConfigError
from loorl.tools.base import ToolCall, ToolError, _call_in_thread, clean_text, clip, run_call
from loorl.util.plugins import import_object

CALL_START, CALL_END = "<tool_call>", "</tool_call>"  # the one call format (Hermes, as Qwen2.5/3 write it)
NOT_TOOLS = ("reset", "get_reward")  # the contract's own methods: never callable by the policy
CALL_KEYS = {"name", "arguments"}  # the keys a call's JSON object may have
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": type(None),
}


def tool_methods(cls: type) -> dict[str, Callable]:
    """The class's tools as TRL picks them: the functions defined on the class (properties are not
    evaluated) whose names neither start with `_` nor are `reset` or `get_reward`."""
    return {
        name: fn
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


def matches(value: Any, schema: dict) -> bool:
    """Whether a JSON value has the type a `get_json_schema` property names (unions, `nullable`,
    enums and array items included; a property without a type takes anything). Booleans are not
    numbers here, as they are not in JSON."""
    if value is None and schema.get("nullable"):
        return True
    if "enum" in schema and value not in schema["enum"]:
        return False
    kinds = schema.get("type")
    if kinds is None:
        return True
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind not in _JSON_TYPES or (kind in ("integer", "number") and isinstance(value, bool)):
            continue
        if not isinstance(value, _JSON_TYPES[kind]):
            continue
        if kind == "array" and "items" in schema and not all(matches(v, schema["items"]) for v in value):
            continue
        return True
    return False


def parse_call(text: str, schemas: dict[str, dict]) -> tuple[str, dict]:
    """(method name, keyword arguments) of a call's text `{"name": ..., "arguments": {...}}`, checked
    against the tools' schemas; `ToolError` saying what is wrong for anything else."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError as err:
        raise ToolError(f"the call is not JSON ({err.msg} at character {err.pos})") from None
    except (ValueError, RecursionError):
        raise ToolError("the call is not JSON") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or set(call) - CALL_KEYS:
        raise ToolError('a call is {"name": "<tool>", "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in schemas:
        raise ToolError(f"no tool named {clip(name, 40)[0]!r}; the tools are {', '.join(sorted(schemas))}")
    if not isinstance(arguments, dict):
        raise ToolError(f"{name}: arguments must be a JSON object")
    params = schemas[name]["function"].get("parameters", {})
    properties, required = params.get("properties", {}), params.get("required", [])
    if missing := [p for p in required if p not in arguments]:
        raise ToolError(f"{name}: missing argument {', '.join(missing)}")
    if extra := [a for a in arguments if a not in properties]:
        raise ToolError(f"{name}: no argument {clip(', '.join(map(str, extra)), 60)[0]}")
    for key, value in arguments.items():
        if not matches(value, properties[key]):
            want = properties[key].get("type", "enum" if "enum" in properties[key] else "?")
            raise ToolError(f"{name}: argument {key} must be {want}, not {type(value).__name__}")
    return name, arguments


class Environment:
    """An environment class read once: its tools' JSON schemas, whether it owns the reward, and the
    limits every call into it runs under."""

    def __init__(self, cls: type, *, timeout_s: float, max_result_chars: int) -> None:
        self.cls, self.timeout_s, self.max_result_chars = cls, timeout_s, max_result_chars
        self.name = cls.__name__
        if not callable(getattr(cls, "reset", None)):
            raise ConfigError(f"environment._target_={self.name} has no reset method (TRL's contract)")
        methods = tool_methods(cls)
        if not methods:
            raise ConfigError(f"environment._target_={self.name} has no public methods: they are its tools")
        from transformers.utils import get_json_schema

        self.schemas = {}
        for name, fn in methods.items():
            try:
                self.schemas[name] = get_json_schema(fn)
            except Exception as err:  # noqa: BLE001 - transformers' docstring/hint errors, one line
                raise ConfigError(
                    f"environment {self.name}.{name}: {err} (each tool needs a docstring with an Args: "
                    "line per argument and type hints, as TRL's tools do)"
                ) from None
        self.owns_reward = callable(getattr(cls, "get_reward", None))

    @classmethod
    def of(cls, target: str, *, timeout_s: float, max_result_chars: int) -> Environment:
        env_class = import_object(target, "environment._target_")
        if not inspect.isclass(env_class):
            raise ConfigError(f"environment._target_={target} is not a class (TRL's environment_factory's)")
        return cls(env_class, timeout_s=timeout_s, max_result_chars=max_result_chars)

    def tools(self) -> list[dict]:
        """The tools' schemas, as a chat template's `tools=` takes them."""
        return list(self.schemas.values())

    def session(self, row: dict) -> Session:
        """A new instance for one sample, reset with the prompt's row (`Session`)."""
        return Session(self, row)


class Session:
    """One sample's instance: built and `reset(**row)` under the call time limit. A constructor or
    reset that raises or hangs leaves the session broken: its calls are errors and its reward is NaN
    (unscorable); the run goes on."""

    def __init__(self, env: Environment, row: dict) -> None:
        self.env, self.instance, self.broken, self.observation = env, None, None, None
        done, value, error = _call_in_thread(lambda _: self._start(row), "", env.timeout_s)
        if not done:
            self.broken = f"reset timed out after {env.timeout_s:g} s"
        elif error is not None:
            self.broken = f"reset failed: {type(error).__name__}: {error}"
        elif value is not None:
            self.observation = clip(clean_text(value), env.max_result_chars)[0]

    def _start(self, row: dict):
        instance = self.env.cls()
        observation = instance.reset(**row)
        self.instance = instance
        return observation

    def call(self, text: str) -> ToolCall:
        """One call's text (between the tags) checked and run; its `ToolCall` (error results included)."""
        if self.broken is not None:
            return ToolCall(self.env.name, text, f"error: the environment's {self.broken}"[:200], "error")
        try:
            name, arguments = parse_call(text, self.env.schemas)
        except ToolError as err:
            result = clip(f"error: {clean_text(str(err))}", self.env.max_result_chars)[0]
            return ToolCall(self.env.name, text, result, "error")
        method = getattr(self.instance, name)  # a name of `schemas`: one of the class's tools
        return run_call(lambda _: method(**arguments), text, name=name, timeout_s=self.env.timeout_s,
                        max_chars=self.env.max_result_chars)  # fmt: skip

    def reward(self) -> float | None:
        """`get_reward()` of the finished sample, under the time limit: None where the class has none
        (the task's reward functions grade it), NaN where it raised, hung or gave no finite number."""
        if not self.env.owns_reward:
            return None
        if self.broken is not None:
            return math.nan
        done, value, error = _call_in_thread(lambda _: self.instance.get_reward(), "", self.env.timeout_s)
        if not done or error is not None:
            return math.nan
        try:
            value = float(value)
        except (TypeError, ValueError):
            return math.nan
        return value if math.isfinite(value) else math.nan


def tools_prompt(target: str) -> str:
    """The tools of the environment class `target` as the Hermes block Qwen2.5's chat template writes
    into its system prompt: for a task's `system_prompt` (`${loorl.environment_tools:...}`)."""
    env = Environment.of(target, timeout_s=1.0, max_result_chars=1)
    listed = "\n".join(json.dumps(schema) for schema in env.tools())
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f'{CALL_START}{CALL_END} XML tags:\n{CALL_START}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{CALL_END}"
    )
