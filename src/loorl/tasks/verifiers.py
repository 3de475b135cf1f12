"""Answer extraction and reward functions for GSM8K-style and MATH-style tasks.

Pure functions of strings: no torch, no model. `math_verify` is imported lazily, only when two MATH
answers differ as normalised strings.

GSM8K
    `extract_gsm8k_answer` pulls a number out of a completion (`strict`: the last `#### <number>`;
    `flexible`: the last number anywhere), `gsm8k_reference` reads the reference out of a dataset
    `answer` field, and `gsm8k_reward` compares the two numerically.

MATH
    `last_boxed` pulls the content of the last `\\boxed{...}`, `normalize_math_answer` canonicalises
    LaTeX answers as strings, `math_answers_equal` falls back to symbolic comparison with
    `math_verify`, and `math_reward` scores a completion against an answer or a full solution text.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

from loorl.errors import ConfigError

__all__ = [
    "GSM8K_ANSWER_MODES",
    "check_answer_mode",
    "extract_final_number",
    "extract_gsm8k_answer",
    "gsm8k_reference",
    "gsm8k_reward",
    "last_boxed",
    "math_answers_equal",
    "math_reward",
    "normalize_math_answer",
]

# ---------------------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------------------

GSM8K_ANSWER_MODES = ("strict", "flexible")

# A number: optional sign and `$` (either order), digits with optional thousands commas, optional decimals.
# The body is an atomic group so that `3.14abc` or `123abc` does not backtrack into a shorter number, and
# the number may not be glued to letters/digits on either side (`abc123`, `3rd`, `H2O` are not numbers).
_NUMBER = (
    r"(?<![\w.])"
    r"(?P<num>[-+]?\$?[-+]?(?>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+))"
    r"(?!\.?\w)"
)
_STRICT_RE = re.compile(r"####\s*" + _NUMBER)
_FLEXIBLE_RE = re.compile(_NUMBER)
_BARE_NUMBER_RE = re.compile(r"\s*" + _NUMBER + r"\s*\.?\s*")


def _normalize_number(raw: str) -> str | None:
    """`$1,234.50` -> `1234.5`, `-0` -> `0`, `18.00` -> `18`, `+5` -> `5`; None if not a number."""
    s = raw.strip().replace("$", "").replace(",", "").rstrip(".")
    negative = s.count("-") % 2 == 1
    s = s.replace("-", "").replace("+", "")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == 0:
        return "0"
    text = format(value.normalize(), "f")
    return "-" + text if negative else text


def check_answer_mode(mode: str) -> None:
    """A one-line ConfigError (a ValueError) for an extraction mode that is not strict or flexible."""
    if mode not in GSM8K_ANSWER_MODES:
        raise ConfigError(f"task.answer_mode={mode!r} is not one of: {', '.join(GSM8K_ANSWER_MODES)}")


def extract_gsm8k_answer(text: str, *, mode: str = "strict") -> str | None:
    """The normalised final answer of a GSM8K completion, or None if there is none.

    `strict`: the last `#### <number>` (spaces, `$`, sign, thousands commas and decimals allowed).
    `flexible`: the last number anywhere in the text (a trailing period or `%` is ignored).
    """
    check_answer_mode(mode)
    pattern = _STRICT_RE if mode == "strict" else _FLEXIBLE_RE
    last = None
    for match in pattern.finditer(text or ""):
        last = match
    return None if last is None else _normalize_number(last.group("num"))


_ENDING_NUMBER_RE = re.compile(_NUMBER + r"[\s.*]*\Z")  # a number, then only spaces, `.` or `*` (bold)


def extract_final_number(text: str, *, mode: str = "strict") -> str | None:
    """The normalised number a short answer ends with, or None.

    `strict`: the text must end with the number (then at most spaces, a period or markdown bold):
    `72`, `12 + 60 = 72.`, `The answer is **72**`. `flexible`: the last number anywhere, as GSM8K's
    flexible mode (`72 is the sum` counts)."""
    check_answer_mode(mode)
    if mode == "flexible":
        return extract_gsm8k_answer(text, mode="flexible")
    match = _ENDING_NUMBER_RE.search(text or "")
    return None if match is None else _normalize_number(match.group("num"))


def gsm8k_reference(answer_field: str) -> str:
    """The normalised reference number of a GSM8K `answer` field (`...#### 72`), or of a bare number."""
    ref = extract_gsm8k_answer(answer_field, mode="strict")
    if ref is None and _BARE_NUMBER_RE.fullmatch(answer_field or ""):
        ref = extract_gsm8k_answer(answer_field, mode="flexible")
    if ref is None:
        raise ValueError(f"no '#### <number>' reference answer in {answer_field[-80:]!r}")
    return ref


def _numbers_equal(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def gsm8k_reward(
    completion: str,
    reference: str,
    *,
    mode: str = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """`correct_score` if the extracted answer equals `reference` numerically, `format_score` if an answer
    was extracted but is wrong, 0.0 if none was extracted. `reference` may be a bare number (`1,000`) or a
    full GSM8K answer field ending in `#### <number>`."""
    pred = extract_gsm8k_answer(completion, mode=mode)
    if pred is None:
        return 0.0
    try:
        ref = gsm8k_reference(reference)
    except ValueError:
        ref = reference.strip()
    return correct_score if _numbers_equal(pred, ref) else format_score


# ---------------------------------------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")


def _balanced_group(text: str, start: int) -> int | None:
    """Index just past the `}` closing the `{` at `text[start]`, or None if it is never closed."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":  # skip the escaped character: `\{` and `\}` do not count
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces allowed) or `\\boxed <token>`.

    None if there is no box, or the last one is unbalanced (e.g. a truncated generation).
    """
    if not text:
        return None
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    pos = matches[-1].end()
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        end = _balanced_group(text, pos)
        return None if end is None else text[pos + 1 : end - 1]
    token = re.match(r"[^\s$]+", text[pos:])
    return token.group(0) if token else None


def _read_arg(s: str, i: int) -> tuple[str, int] | None:
    """One TeX macro argument at `s[i:]` (after spaces): `{...}`, `\\command` or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        end = _balanced_group(s, i)
        return None if end is None else (s[i + 1 : end - 1], end)
    if s[i] == "\\":
        m = re.match(r"\\(?:[a-zA-Z]+|.)", s[i:])
        return m.group(0), i + m.end()
    if s[i] in "}^_&":
        return None
    return s[i], i + 1


def _brace_macro_args(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`, `\\sqrt[3]8` likewise."""
    out: list[str] = []
    i = 0
    macro_re = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
    while True:
        m = macro_re.search(s, i)
        if m is None:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i : m.end()])
        j = m.end()
        nargs = 2 if m.group(1) == "frac" else 1
        if m.group(1) == "sqrt":
            opt = re.match(r"\s*\[[^\]]*\]", s[j:])
            if opt:
                out.append(opt.group(0).strip())
                j += opt.end()
        args = []
        for _ in range(nargs):
            arg = _read_arg(s, j)
            if arg is None:
                break
            args.append(arg[0])
            j = arg[1]
        if len(args) < nargs:  # malformed: leave the rest of this macro untouched
            i = m.end()
            continue
        out.append("".join("{" + _brace_macro_args(a) + "}" for a in args))
        i = j


# `\text{ cm}` (optionally `^2`) right after a number and at the end of the answer or before a separator.
_UNIT_RE = re.compile(
    r"(?<=[\d}])\s*\\(?:text|textrm|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?(?=\s*(?:$|[,;)\]]|\\\}))"
)
_TEXT_RE = re.compile(r"\\(?:text|textrm|textbf|mbox|mathrm)\{([^{}]*)\}")
_DEGREE_RE = re.compile(r"\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ(?![a-zA-Z]))|°")
_ASSIGNMENT_RE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?=(?!=)")


def _strip_spaces(s: str) -> str:
    """Drop whitespace, except one space between a `\\command` and a following letter (`\\pi r`)."""

    def repl(m: re.Match[str]) -> str:
        before, after = s[: m.start()], s[m.end() : m.end() + 1]
        keep = re.search(r"\\[a-zA-Z]+$", before) is not None and after.isalpha()
        return " " if keep else ""

    return re.sub(r"\s+", repl, s)


def normalize_math_answer(ans: str) -> str:
    """Canonical string form of a LaTeX answer, so that trivially different forms compare equal.

    Removes `$`, `\\left`/`\\right`, thin spaces, `\\displaystyle`, degrees, `%`, units after a number,
    a trailing `.` and a leading single-variable assignment (`x=`); `\\dfrac`/`\\tfrac` -> `\\frac`,
    `\\frac12` -> `\\frac{1}{2}`, `\\text{...}` unwrapped; whitespace removed.
    """
    s = (ans or "").strip()
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[!,;: ]", "", s)
    s = re.sub(r"\\(?:displaystyle|textstyle)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _UNIT_RE.sub("", s)
    s = _TEXT_RE.sub(lambda m: m.group(1), s)
    s = _brace_macro_args(s)
    s = _strip_spaces(s.strip())
    s = s.rstrip(".")
    if s.count("=") == 1:
        s = _ASSIGNMENT_RE.sub("", s)
    s = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", s)  # `.5` -> `0.5`
    return s


def _verify_kwargs() -> tuple[dict, dict]:
    """math_verify times out with SIGALRM, which only works in the main thread: disable it elsewhere."""
    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    return {"parsing_timeout": seconds}, {"timeout_seconds": seconds}


def math_answers_equal(pred: str, ref: str) -> bool:
    """True if `pred` and `ref` are the same answer: equal after `normalize_math_answer`, or judged
    equivalent by `math_verify` (any error or timeout there counts as not equal)."""
    p, r = normalize_math_answer(pred), normalize_math_answer(ref)
    if not p or not r:
        return False
    if p == r:
        return True
    try:
        from math_verify import parse, verify

        parse_kw, verify_kw = _verify_kwargs()
        gold = parse(f"${r}$", **parse_kw)
        target = parse(f"${p}$", **parse_kw)
        if not gold or not target:
            return False
        return bool(verify(gold, target, **verify_kw))
    except Exception:
        return False


def math_reward(
    completion: str,
    reference: str,
    *,
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """`correct_score` if the completion's last boxed answer equals the reference, `format_score` if it
    has a boxed answer that is wrong, 0.0 if it has none. `reference` is a bare answer or a solution text
    with a `\\boxed{}` answer (the MATH dataset's `solution` field)."""
    pred = last_boxed(completion)
    if pred is None:
        return 0.0
    ref = last_boxed(reference) if _BOXED_RE.search(reference or "") else None
    if ref is None:
        ref = reference or ""
    return correct_score if math_answers_equal(pred, ref) else format_score
