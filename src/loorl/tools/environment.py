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
import pickle
import time
from collections.abc import Callable
from typing import Any

from loorl.errors import ConfigError
from loorl.tools.base import ToolCall, ToolError, _call_in_thread, clean_text, clip, run_call
from loorl.tools.env_process import Worker, WorkerLost, WorkerPool
from loorl.tools.env_worker import awaited
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


ISOLATIONS = ("process", "thread")  # environment.isolation


class Environment:
    """An environment class read once: its tools' JSON schemas, whether it owns the reward, the limits
    every call into it runs under, and where its instances live (`isolation`: process, each sample's
    in a worker process, `loorl.tools.env_process`; thread, in the training process)."""

    def __init__(self, cls: type, *, timeout_s: float, max_result_chars: int, isolation: str = "process",
                 memory_mb: int = 1024, workers: int | None = None) -> None:  # fmt: skip
        self.cls, self.timeout_s, self.max_result_chars = cls, timeout_s, max_result_chars
        self.isolation, self.memory_mb, self.workers = isolation, memory_mb, workers
        self.name = cls.__name__
        if isolation not in ISOLATIONS:
            raise ConfigError(f"environment.isolation={isolation} must be one of {', '.join(ISOLATIONS)}")
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
        if isolation == "process":
            try:  # what a worker process is sent: the class by reference (its module and name)
                pickle.dumps(cls)
            except Exception as err:  # noqa: BLE001 - a class of __main__, a local class, one line
                raise ConfigError(
                    f"environment._target_={self.name} cannot be sent to a worker process ({err}); define it "
                    "in an importable module, or set environment.isolation=thread"
                ) from None
        self._pool = None  # the worker processes (isolation process), started by the first session

    @classmethod
    def of(cls, target: str, **settings) -> Environment:
        env_class = import_object(target, "environment._target_")
        if not inspect.isclass(env_class):
            raise ConfigError(f"environment._target_={target} is not a class (TRL's environment_factory's)")
        return cls(env_class, **settings)

    def __getstate__(self) -> dict:
        """Pickled without its worker processes (a sampler process starts its own)."""
        return {**self.__dict__, "_pool": None}

    def tools(self) -> list[dict]:
        """The tools' schemas, as a chat template's `tools=` takes them."""
        return list(self.schemas.values())

    def session(self, row: dict, seed: int | None = None) -> Session:
        """A new instance for one sample, reset with the prompt's row; `seed`: its worker's random
        streams (isolation process)."""
        if self.isolation == "thread":
            return ThreadSession(self, row)
        if self._pool is None:
            self._pool = WorkerPool(self.cls, memory_mb=self.memory_mb, max_chars=self.max_result_chars,
                                    workers=self.workers)  # fmt: skip
        return ProcessSession(self, self._pool, row, seed)

    @property
    def pool(self):
        """The worker processes (None before the first session, and with isolation thread)."""
        return self._pool

    def close(self) -> None:
        """End the worker processes (a later session starts them again)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class Environments:
    """Several environments routed by a column of the prompt's row, as TRL's dict `environment_factory`
    routes them (`environment.routes`, `environment.route_column`): each row names its environment; its
    sample's instance is of that class, its calls are checked against that class's tools only, and the
    column itself is not passed to `reset` (TRL's `environment` field is not either)."""

    def __init__(self, routes: dict[str, Environment], column: str) -> None:
        self.routes, self.column = routes, column
        self.name = "+".join(routes)

    def session(self, row: dict, seed: int | None = None) -> Session:
        name = row.get(self.column)
        if name not in self.routes:
            raise ConfigError(
                f"a prompt's {self.column}={name!r} names none of environment.routes "
                f"({', '.join(self.routes)}): give every row a {self.column} column naming one, or set "
                "environment.route_column"
            )
        return self.routes[name].session({k: v for k, v in row.items() if k != self.column}, seed)

    def tools(self) -> dict[str, list[dict]]:
        """Each route's tools' schemas, by name (a prompt carries its row's environment's)."""
        return {name: env.tools() for name, env in self.routes.items()}

    def close(self) -> None:
        for env in self.routes.values():
            env.close()


class Session:
    """One sample's instance of the environment. A constructor or reset that fails (raises, hangs, or
    in a worker process exits, crashes or runs out of memory) leaves the session broken: its calls
    are errors and its reward is NaN (unscorable); the run goes on. `events`: what went wrong in it,
    for the step's counts (`ENVIRONMENT_EVENTS`)."""

    env: Environment
    broken: str | None = None
    observation: str | None = None

    def __init__(self) -> None:
        self.events: list[str] = []

    def call(self, text: str) -> ToolCall:
        """One call's text (between the tags) checked and run; its `ToolCall` (error results included)."""
        if self.broken is not None:
            return ToolCall(self.env.name, text, f"error: the environment's {self.broken}"[:200], "error")
        try:
            name, arguments = parse_call(text, self.env.schemas)
        except ToolError as err:
            result = clip(f"error: {clean_text(str(err))}", self.env.max_result_chars)[0]
            return ToolCall(self.env.name, text, result, "error")
        return self._invoke(text, name, arguments)

    def _invoke(self, text: str, name: str, arguments: dict) -> ToolCall:  # pragma: no cover - subclasses'
        raise NotImplementedError

    def reward(self) -> float | None:
        """`get_reward()` of the finished sample, under the time limit: None where the class has none
        (the task's reward functions grade it), NaN where it failed or gave no finite number."""
        if not self.env.owns_reward:
            return None
        if self.broken is not None:  # counted where it broke
            return math.nan
        try:
            value = float(self._reward())
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            self.events.append("reward_failed")
            return math.nan
        return value

    def _reward(self):  # pragma: no cover - subclasses'
        raise NotImplementedError

    def close(self) -> None:
        """The sample is done: free its instance."""
        return None


class ThreadSession(Session):
    """`environment.isolation=thread`: the instance lives in the training process and each method runs
    in a thread of its own under the time limit (`run_call`). A method that hangs keeps its thread
    (Python cannot end one), one that exits or crashes ends the run, and its memory is the trainer's."""

    def __init__(self, env: Environment, row: dict) -> None:
        super().__init__()
        self.env, self.instance = env, None
        done, value, error = _call_in_thread(lambda _: self._start(row), "", env.timeout_s)
        if not done:
            self.broken = f"reset timed out after {env.timeout_s:g} s"
        elif error is not None:
            self.broken = f"reset failed: {type(error).__name__}: {error}"
        elif value is not None:
            self.observation = clip(clean_text(value), env.max_result_chars)[0]
        if self.broken is not None:
            self.events.append("reset_failed")

    def _start(self, row: dict):
        instance = self.env.cls()
        observation = awaited(instance.reset(**row))
        self.instance = instance
        return observation

    def _invoke(self, text: str, name: str, arguments: dict) -> ToolCall:
        method = getattr(self.instance, name)  # a name of `schemas`: one of the class's tools
        return run_call(lambda _: awaited(method(**arguments)), text, name=name, timeout_s=self.env.timeout_s,
                        max_chars=self.env.max_result_chars)  # fmt: skip

    def _reward(self):
        done, value, error = _call_in_thread(
            lambda _: awaited(self.instance.get_reward()), "", self.env.timeout_s
        )
        return value if done and error is None else math.nan


class ProcessSession(Session):
    """One sample's instance in a worker process (module docstring): built and reset there, each call
    and `get_reward` a message under the time limit. `events` records a failed start or reward, each
    worker this session's call ended ("worker_lost"), and a session lost with a worker another
    session's call ended ("session_lost")."""

    def __init__(self, env: Environment, pool: WorkerPool, row: dict, seed: int | None) -> None:
        super().__init__()
        self.env, self.pool = env, pool
        self.worker: Worker | None = None
        try:
            self.worker, self.sid = pool.acquire()
            kind, value = self._ask(("start", self.sid, row, seed))
        except WorkerLost as err:
            kind, value = "error", err.why if err.kind == "lost" else f"worker process {err.why}"
        except Exception as err:  # noqa: BLE001 - e.g. a row that does not pickle: this sample's failure
            kind, value = "error", f"{type(err).__name__}: {err}"
        if kind == "ok":
            self.observation = value
        else:
            self.broken = f"reset failed: {value}"
            self.events.append("reset_failed")

    def _ask(self, message: tuple) -> tuple:
        """The worker's answer; a lost worker is recorded and raised again."""
        try:
            return self.pool.ask(self.worker, message, self.env.timeout_s)
        except WorkerLost as err:
            self.events.append("session_lost" if err.kind == "lost" else "worker_lost")
            self.broken = err.why if err.kind == "lost" else f"worker process {err.why}"
            raise

    def _invoke(self, text: str, name: str, arguments: dict) -> ToolCall:
        start = time.perf_counter()
        try:
            answer = self._ask(("call", self.sid, name, arguments))
        except WorkerLost as err:
            status = "timeout" if err.kind == "timeout" else "crashed"
            result = f"error: timed out after {self.env.timeout_s:g} s" if err.kind == "timeout" else (
                f"error: the environment's {self.broken}")  # fmt: skip
            return ToolCall(
                name, text, result[: self.env.max_result_chars], status, time.perf_counter() - start
            )
        seconds = time.perf_counter() - start
        if answer[0] == "error":
            return ToolCall(
                name, text, clip(f"error: {answer[1]}", self.env.max_result_chars)[0], "error", seconds
            )
        return ToolCall(name, text, answer[1], "truncated" if answer[2] else "ok", seconds)

    def _reward(self):
        try:
            kind, value = self._ask(("reward", self.sid))
        except WorkerLost:
            return math.nan
        return value if kind == "ok" else math.nan

    def close(self) -> None:
        if self.worker is not None:
            self.pool.release(self.worker, self.sid)
            self.worker = None


def tools_prompt(target: str) -> str:
    """The tools of the environment class `target` as the Hermes block Qwen2.5's chat template writes
    into its system prompt: for a task's `system_prompt` where `environment.tools_in_prompt=false` (with it
    true, the chat template writes them from `tools=`, and this would write them twice)."""
    env = Environment.of(target, timeout_s=1.0, max_result_chars=1, isolation="thread")
    listed = "\n".join(json.dumps(schema) for schema in env.tools())
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f'{CALL_START}{CALL_END} XML tags:\n{CALL_START}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{CALL_END}"
    )
