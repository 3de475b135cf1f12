"""Test environments in TRL's `environment_factory` contract, in a module of their own that imports only
the standard library, so that a worker process (`environment.isolation=process`) starts in ~0.1 s.

`Counter` keeps state; `Hostile` fails in every way a method can (raises, hangs busily, exits the
process, segfaults, allocates 4 GB, answers too much), and `Sabotage` does so inside a calculator a
warm-started policy calls (`experiment=tiny_sum_calculator`), for training runs."""

from __future__ import annotations

import ast
import ctypes
import os
import random
import time

HOSTILE_MODES = ("hang", "exit", "segfault", "memory", "raise")
_HELD: list[bytearray] = []  # what `fail("memory")` allocated


def fail(mode: str) -> None:
    """Do what `mode` names: spin forever, exit the process with status 3, dereference NULL, allocate 4
    GB and touch it, or raise."""
    if mode == "hang":
        while True:  # busy: a thread left behind would keep a core
            pass
    if mode == "exit":
        os._exit(3)
    if mode == "segfault":
        ctypes.string_at(0)
    if mode == "memory":  # kept, as a leak keeps it: in the training process (isolation thread) it stays
        _HELD.append(bytearray(4 << 30))
        _HELD[-1][:: 1 << 12] = b"x" * len(_HELD[-1][:: 1 << 12])
    if mode == "raise":
        raise RuntimeError("kaboom")


class Counter:
    """`reset` keeps the row, `add` adds to a running total, `get_reward` reads it."""

    def __init__(self) -> None:
        self.row, self.total, self.calls = None, 0, 0

    def reset(self, **row) -> str | None:
        self.row = row
        return None

    def add(self, a: int, b: int = 0) -> int:
        """Add two integers to the running total.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        self.total += a + b
        return self.total

    def pid(self) -> int:
        """The process this instance lives in."""
        return os.getpid()

    def _secret(self) -> str:
        raise AssertionError("a private method was called")

    def get_reward(self) -> float:
        return float(self.total == int(self.row["answer"]))


class Hostile(Counter):
    """Every failure a method can have, one method each; `reset` and `get_reward` fail on the row's
    `fail` field, the constructor on the class attribute `fail_in_init`."""

    fail_in_init: str | None = None

    def __init__(self) -> None:
        super().__init__()
        if self.fail_in_init:
            fail(self.fail_in_init)

    def reset(self, **row) -> str | None:
        if row.get("fail_in") == "reset":
            fail(row["fail"])
        return super().reset(**row)

    def boom(self) -> str:
        """Raise."""
        fail("raise")

    def hang(self) -> str:
        """Spin forever."""
        fail("hang")

    def sleep(self, seconds: float) -> str:
        """Sleep, then answer.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "slept"

    def exit(self) -> str:
        """Exit the process with status 3."""
        fail("exit")

    def segfault(self) -> str:
        """Dereference NULL."""
        fail("segfault")

    def memory(self) -> str:
        """Allocate 4 GB."""
        fail("memory")

    def huge(self) -> str:
        """A very long answer."""
        return "x" * 100_000

    async def add_later(self, a: int) -> int:
        """Add an integer, asynchronously.

        Args:
            a: The integer.
        """
        return self.add(a)

    def get_reward(self) -> float:
        if self.row.get("fail_in") == "get_reward":
            fail(self.row["fail"])
        return super().get_reward()


class Greeter(Counter):
    """`reset` returns text: inserted before the sample's first turn, masked."""

    def reset(self, **row) -> str | None:
        super().reset(**row)
        return f"Start at {row['answer']}."


class RandomStart(Counter):
    """`reset` returns a text drawn from `random`: each sample its own (its worker's stream is seeded per
    sample, `environment.isolation=process`)."""

    def reset(self, **row) -> str | None:
        super().reset(**row)
        return f"Start at {random.randrange(10**6)}."


class Unrouted(Counter):
    """Refuses a row that still holds the routing column (TRL does not pass it to `reset` either)."""

    def reset(self, **row) -> str | None:
        if "environment" in row:
            raise ValueError("reset was given the routing column")
        return super().reset(**row)


class AsyncReward(Counter):
    async def get_reward(self) -> float:
        return 0.25


class InitFails(Hostile):
    fail_in_init = "exit"


def once() -> str | None:
    """The next failure mode of `LOORL_FAIL_ONCE` (comma-separated `HOSTILE_MODES`) not yet done in this
    run: each mode happens once, in whichever process or thread claims it first (a marker file created
    exclusively in the folder `LOORL_FAIL_ONCE_DIR`). None when every mode is done, or none is asked."""
    folder = os.environ.get("LOORL_FAIL_ONCE_DIR")
    for mode in filter(None, os.environ.get("LOORL_FAIL_ONCE", "").split(",")):
        try:
            os.close(os.open(os.path.join(folder, mode), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return mode
    return None


def resets_so_far() -> int:
    """This reset's number in the run (0, 1, ...), over every process and thread: each claims the next
    free marker in `LOORL_FAIL_ONCE_DIR`/resets."""
    folder = os.path.join(os.environ["LOORL_FAIL_ONCE_DIR"], "resets")
    os.makedirs(folder, exist_ok=True)
    n = len(os.listdir(folder))
    while True:
        try:
            os.close(os.open(os.path.join(folder, str(n)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            n += 1


class FailOnce(Counter):
    """`reset` does each failure of `LOORL_FAIL_ONCE` once in the run (`once`), then never again: the
    steps after it show what the failure left behind. `LOORL_FAIL_AFTER`: the resets that pass first
    (the validation before step 0 takes the quick run's first 16 x 5)."""

    def reset(self, **row) -> str | None:
        if resets_so_far() >= int(os.environ.get("LOORL_FAIL_AFTER", "0")) and (mode := once()):
            fail(mode)
        return super().reset(**row)


class Sabotage:
    """The worked example's calculator (examples/environments/sum_calculator.py) for a warm-started policy
    that calls it (`experiment=tiny_sum_calculator`): each failure of `LOORL_FAIL_ONCE` happens once, in
    a call (`once`). No `get_reward`: the task grades the answer."""

    def reset(self, **row) -> str | None:
        return None

    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression exactly.

        Args:
            expression: The expression to evaluate, with integers, +, -, * and parentheses, e.g. "12+30".
        """
        if mode := once():
            fail(mode)
        return str(_value(ast.parse(expression.strip()[:100], mode="eval").body))


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        return left - right if isinstance(node.op, ast.Sub) else left * right
    raise ValueError("only integers, + - * and parentheses")


class RowSabotage(Counter):
    """`reset` and `get_reward` that fail on the rows whose answer ends in a digit of `FAILS` (the
    arithmetic task's answers: about one sample in ten for each mode), for a training run of a policy
    that never calls a tool: hang busily, exit, segfault and allocate 4 GB, each on some rows."""

    FAILS = {"1": ("reset", "hang"), "2": ("reset", "exit"), "3": ("get_reward", "segfault"),
             "4": ("get_reward", "memory")}  # fmt: skip

    def _fail_in(self, where: str) -> None:
        when, mode = self.FAILS.get(str(self.row["answer"])[-1:], (None, None))
        if when == where:
            fail(mode)

    def reset(self, **row) -> str | None:
        super().reset(**row)
        self._fail_in("reset")
        return None

    def get_reward(self) -> float:
        self._fail_in("get_reward")
        return float(len(str(self.row["answer"])) % 2)
