"""Tools (`loorl.tools`): the calculator by hand, the limits of a call (errors, time-outs, huge and
invalid output), hostile Python through the sandbox, and the call tags."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from loorl.errors import ConfigError
from loorl.models.tiny import build_char_tokenizer
from loorl.tools.base import ToolError, run_call
from loorl.tools.calculator import Calculator, evaluate, format_number
from loorl.tools.python import Python
from loorl.tools.toolset import BoundTool, ToolSet, check_tags, tag_variants


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("123*456", "56088"),
        ("0.1+0.2", "0.3"),  # exact decimals, not binary floats
        ("7/2", "3.5"),
        ("1/3", "0.333333333333"),
        ("2/3", "0.666666666667"),  # rounded half to even at 12 places
        ("-2.50*4", "-10"),
        ("(1 + 2) * 3", "9"),
        ("10 // 3", "3"),
        ("10 % 3", "1"),
        ("2**-2", "0.25"),
        ("3 × 4 ÷ 8", "1.5"),
        (".5+1.", "1.5"),
        ("123456789*987654321", "121932631112635269"),
        ("417+382+905+266", "1970"),
    ],
)
def test_the_calculator_by_hand(expression, expected):
    assert Calculator()(expression) == expected


def test_the_calculator_is_exact_where_floats_are_not():
    assert evaluate("0.1*3") == Fraction(3, 10) and 0.1 * 3 != 0.3
    assert format_number(Fraction(1, 8)) == "0.125" and format_number(Fraction(-5, 2)) == "-2.5"


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "not arithmetic"),
        ("import os", "not arithmetic"),
        ("1e5", "not arithmetic"),
        ("9**9**9", "too large"),  # refused before it is computed
        ("1/0", "division by zero"),
        ("0**-1", "division by zero"),
        ("2**0.5", "whole-number powers"),
        ("1.2.3", "not a number"),
        ("(1+", "cannot parse"),
        ("", "empty"),
        ("1+" * 150 + "1", "longer than"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    start = time.perf_counter()
    with pytest.raises(ToolError, match=message):
        Calculator()(expression)
    assert time.perf_counter() - start < 1.0


def test_a_call_that_raises_hangs_or_floods_becomes_its_result():
    def boom(text):
        raise RuntimeError("bad " + text)

    def hang(text):
        time.sleep(30)

    def flood(text):
        return "x" * 10_000_000

    call = run_call(boom, "1", name="boom", timeout_s=5, max_chars=100)
    assert (call.status, call.result) == ("error", "error: RuntimeError: bad 1") and call.failed
    start = time.perf_counter()
    call = run_call(hang, "1", name="hang", timeout_s=0.3, max_chars=100)
    assert call.status == "timeout" and call.result == "error: timed out after 0.3 s"
    assert time.perf_counter() - start < 2.0  # the thread is left behind, the rollout is not
    call = run_call(flood, "1", name="flood", timeout_s=5, max_chars=100)
    assert call.status == "truncated" and len(call.result) == 100 and call.result.endswith("more characters]")
    call = run_call(lambda t: b"\xff\xfeok", "1", name="bytes", timeout_s=5, max_chars=100)
    assert call.status == "ok" and call.result == "\ufffd\ufffdok"  # invalid UTF-8 replaced
    call = run_call(lambda t: "\ud800x", "1", name="surrogate", timeout_s=5, max_chars=100)
    assert call.result == "?x" and call.result.encode("utf-8")
    assert run_call(lambda t: 42, "1", name="int", timeout_s=5, max_chars=100).result == "42"


@pytest.mark.parametrize(
    "program, status, says",
    [
        ("print(123 * 456)", "ok", "56088\n"),
        ("while True:\n    pass", "timeout", "ran past 2 s"),
        ("import os\nwhile True:\n    os.fork()", "error", "error: "),  # the process limit
        ("print('x' * 100_000_000)", "error", "wrote more than 1 MB"),
        ("import sys\nsys.stdout.buffer.write(bytes([255, 254]) + b'ok')", "ok", "\ufffd\ufffdok"),
        ("1 / 0", "error", "ZeroDivisionError"),
    ],
)
def test_hostile_python_ends_as_an_error_or_timeout_inside_its_limit(program, status, says):
    start = time.perf_counter()
    call = run_call(Python(timeout_s=2), program, name="python", timeout_s=10, max_chars=200)
    assert call.status == status and says in call.result, call
    assert time.perf_counter() - start < 10


CALC = BoundTool("calculator", Calculator(), "<calc>", "</calc>")
PY = BoundTool("python", Python(timeout_s=2), "<python>", "</python>")


def _toolset(*tools):
    return ToolSet(list(tools or (CALC,)), timeout_s=5, max_result_chars=64)


def test_a_call_in_a_turn_and_the_malformed_ones():
    tools = _toolset(CALC, PY)
    call = tools.call_in_turn(CALC, "so 12*3 is <calc>12*3</calc>")
    assert (call.tool, call.text, call.result, call.status) == ("calculator", "12*3", "36", "ok")
    assert tools.call_in_turn(CALC, "12*3</calc>").status == "error"  # closed, never opened
    nested = tools.call_in_turn(CALC, "<calc>1+<calc>2</calc>")
    assert nested.status == "nested" and nested.failed
    assert tools.call_in_turn(CALC, "<calc>1+<python>2</calc>").status == "nested"
    assert tools.unclosed("the answer is <calc>12*3 and then").status == "unclosed"
    assert tools.unclosed("<calc>1</calc> done") is None
    assert tools.result_text(call) == " <result>36</result>"


def _merging_tokenizer():
    """A character BPE tokenizer that merges " <" and "><", as GPT-2-style tokenizers do (SmolLM2's
    writes `</calc><result>` as `</`, `calc`, `><`, `result`, `>`)."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate(["<unk>", *chars, " <", "><"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[(" ", "<"), (">", "<")], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def test_the_closing_tags_tokens_end_a_turn():
    tok = build_char_tokenizer()
    tools = _toolset(CALC, PY)
    stops = tools.stop_ids(tok)
    turn = tok.encode("x<calc>1+1</calc>", add_special_tokens=False)
    assert tools.closed_by(turn, stops) is CALC and tools.closed_by(turn[:-1], stops) is None
    check_tags(tok, tools.tools, result_format=tools.result_format)  # a character tokenizer keeps tags apart


def test_a_tag_written_with_the_space_before_it_ends_a_turn_too():
    tok = _merging_tokenizer()
    variants = tag_variants(tok, "</calc>")
    assert [tok.decode(v) for v in variants] == ["</calc>", " </calc>"]  # " <" is one token
    tools = _toolset(CALC)
    spaced = tok.encode("12*3 </calc>", add_special_tokens=False)
    assert spaced[-len(variants[1]) :] == variants[1] and tools.closed_by(spaced, tools.stop_ids(tok)) is CALC


def test_a_tag_that_ends_inside_a_token_closes_the_call_from_the_text():
    """vLLM matches a multi-token tag as a stop string on its text: the turn may end on a token that holds
    the tag's last characters and more (`><`). The ids do not end with a variant of the tag, the text
    does close the call, and the call is what lies between the tags."""
    tok = _merging_tokenizer()
    tools = _toolset(CALC)
    turn = tok.encode("so <calc>2*3</calc><", add_special_tokens=False)
    assert tok.decode(turn[-1:]) == "><"
    assert tools.closed_by(turn, tools.stop_ids(tok)) is None
    assert tools.closed_in_text(tok.decode(turn), tok.decode(turn[:-1])) is CALC
    assert tools.closed_in_text(tok.decode(turn[:-1]), tok.decode(turn[:-2])) is None  # not closed yet
    call = tools.call_in_turn(CALC, tok.decode(turn))
    assert (call.text, call.result, call.status) == ("2*3", "6", "ok")


def test_tags_that_merge_with_the_result_or_overlap_are_refused():
    tok = build_char_tokenizer()
    with pytest.raises(ConfigError, match="ends like tools.available.calculator.end"):
        check_tags(tok, [CALC, BoundTool("other", Calculator(), "<c>", "c>")], result_format="{result}")
    with pytest.raises(ConfigError, match="non-empty"):
        check_tags(tok, [BoundTool("empty", Calculator(), "", "</x>")], result_format="{result}")
    merging = _merging_tokenizer()
    with pytest.raises(
        ConfigError, match=r"calculator.end='</calc>': the tokenizer merges its end with the result"
    ):
        check_tags(merging, [CALC], result_format="<result>{result}</result>")  # "><" is one token
    check_tags(merging, [CALC], result_format=" = {result}")
