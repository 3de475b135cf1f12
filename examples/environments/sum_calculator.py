"""A worked environment written to TRL's `environment_factory` contract, with no loorl import: the
same file runs in loorl (`environment._target_=sum_calculator.SumCalculatorEnv`, with
`PYTHONPATH=examples/environments`) and in TRL (`GRPOTrainer(environment_factory=SumCalculatorEnv)`).

The task is loorl's `long_sums` (four 3-digit numbers, `123+456+789+101=`), which the tiny model
cannot add in its head. The environment gives it one tool, `calculate`, an exact integer
calculator; the policy calls it as
`<tool_call>{"name": "calculate", "arguments": {"expression": "123+456+789+101"}}</tool_call>`,
reads `<tool_response>1469</tool_response>` and writes the answer.

It has no `get_reward`: the environment never sees the answer the policy writes after the result,
so the reward is the task's (loorl: `task=long_sums`' verifier on the text after the last result;
TRL: a reward function). A `get_reward` of "the last calculation gave the row's answer" was tried
first and was gamed: the policy kept calling the tool and stopped writing the answer
(docs/how-to/environments.md).
"""

from __future__ import annotations

import ast

MAX_CHARS = 100  # the longest expression accepted
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _value(node: ast.AST) -> int:
    """An integer expression's value: integer literals, + - *, unary minus, parentheses; else ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only integers, + - * and parentheses")


class SumCalculatorEnv:
    """One sample's calculator: the prompt's row arrives in `reset`; `calculate` is its one tool."""

    def __init__(self) -> None:
        self.answer: int | None = None
        self.results: list[int] = []

    def reset(self, **row) -> str | None:
        """A new sample: keep the row's reference answer (loorl passes `prompt`, `answer` and the
        task's columns; TRL the dataset row's). Nothing is added to the prompt."""
        self.answer = int(row["answer"]) if row.get("answer") is not None else None
        self.results = []
        return None

    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression exactly.

        Args:
            expression: The expression to evaluate, with integers, +, -, * and parentheses, e.g. "12+30".
        """
        if len(expression) > MAX_CHARS:
            raise ValueError(f"expression longer than {MAX_CHARS} characters")
        value = _value(ast.parse(expression.strip(), mode="eval").body)
        self.results.append(value)
        return str(value)
