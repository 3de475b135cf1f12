"""`loorl.tools.Calculator`: exact arithmetic on integers and decimals, with nothing of Python's `eval`.

Written by hand because the libraries that evaluate expressions safely do not do it exactly:
`simpleeval` and `asteval` compute `0.1 + 0.2` in binary floats (0.30000000000000004), and sympy's
`parse_expr` runs `eval` on the text. Here the expression is parsed by `ast.parse(mode="eval")`,
only number literals, `+ - * / // % **`, unary signs and parentheses are accepted, and every value
is a `fractions.Fraction`, so decimals are exact. Work is bounded before it is done (the text's
length, the size of a power's result), so no call can run away.
"""

from __future__ import annotations

import ast
from fractions import Fraction

from loorl.tools.base import Tool, ToolError

MAX_CHARS = 200  # the longest expression accepted
MAX_RESULT_BITS = 4096  # a power whose result would be larger is refused before it is computed
DECIMALS = 12  # places of a result that has no exact decimal form (1/3), rounded half to even

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}
_SYMBOLS = {"×": "*", "÷": "/", "−": "-", "^": "**"}  # what people write, as Python's operators


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only whole-number powers are exact")
    bits = max(abs(base.numerator).bit_length(), abs(base.denominator).bit_length(), 1)
    if bits * abs(exponent.numerator) > MAX_RESULT_BITS:
        raise ToolError("the power is too large")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    return base ** int(exponent)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    # decimals arrive as (n / 10^k) (`_exact_decimals`): the only literals left are integers
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _value(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if type(node.op) in _BINARY:
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolError("division by zero")
            return _BINARY[type(node.op)](left, right)
    raise ToolError(f"not arithmetic: {ast.unparse(node)[:40]!r}")


def _exact_decimals(text: str) -> str:
    """The expression with each decimal literal `1.25` written as the exact `(125/100)`, so the
    parsed tree never holds a binary float."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or (ch == "." and i + 1 < len(text) and text[i + 1].isdigit()):
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] in "._"):
                j += 1
            literal = text[i:j].replace("_", "")
            if literal.count(".") > 1:
                raise ToolError(f"not a number: {literal!r}")
            if "." in literal:
                whole, frac = literal.split(".")
                out.append(f"({int(whole or '0') * 10 ** len(frac) + int(frac or '0')}/{10 ** len(frac)})")
            else:
                out.append(literal)
            i = j
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; `ToolError` saying why for anything else."""
    text = expression.strip()
    for symbol, op in _SYMBOLS.items():
        text = text.replace(symbol, op)
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    if any(c.isalpha() or c in "_[]{}:;,'\"\\@=<>!&|~" for c in text.replace("**", "")):
        raise ToolError(f"not arithmetic: {text[:40]!r}")
    try:
        tree = ast.parse(_exact_decimals(text), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {text[:40]!r}") from None
    return _value(tree)


def _multiplicity(n: int, p: int) -> int:
    """How many times the prime `p` divides `n`."""
    count = 0
    while n % p == 0:
        n //= p
        count += 1
    return count


def format_number(value: Fraction) -> str:
    """An integer as itself; a fraction as its exact decimal where it has one (denominator 2^a 5^b),
    else rounded to `DECIMALS` places. No exponent notation, no trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    twos, fives = _multiplicity(value.denominator, 2), _multiplicity(value.denominator, 5)
    terminating = value.denominator == 2**twos * 5**fives
    places = max(twos, fives) if terminating else DECIMALS  # terminating: exactly the places it needs
    scaled = round(value * 10**places)  # half to even
    sign = "-" if scaled < 0 else ""
    digits = str(abs(scaled)).rjust(places + 1, "0")
    text = f"{sign}{digits[:-places]}.{digits[-places:]}" if places else f"{sign}{digits}"
    return text.rstrip("0").rstrip(".") if "." in text else text


class Calculator(Tool):
    """`<calc>123*456</calc>` -> `56088`. Exact: `0.1+0.2` is `0.3`, `7/2` is `3.5`, `1/3` is
    `0.333333333333`."""

    name = "calculator"

    def __call__(self, text: str) -> str:
        return format_number(evaluate(text))
