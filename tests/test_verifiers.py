"""Table-driven tests for the GSM8K and MATH answer verifiers in `loorl.tasks.verifiers`."""

from __future__ import annotations

import threading

import pytest

from loorl.tasks.verifiers import (
    extract_final_number,
    extract_gsm8k_answer,
    gsm8k_reference,
    gsm8k_reward,
    last_boxed,
    math_answers_equal,
    math_reward,
    normalize_math_answer,
)

# ---------------------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------------------

# (text, strict, flexible)
GSM8K_CASES = [
    ("#### 72", "72", "72"),
    ("####72", "72", "72"),
    ("She pays 3 * 24 = 72 dollars.\n#### 72", "72", "72"),
    ("#### $1,234.50", "1234.5", "1234.5"),
    ("#### -3", "-3", "-3"),
    ("#### +7", "7", "7"),
    ("#### 5\nWait, I made an error.\n#### 6", "6", "6"),
    ("#### 1 #### 2 #### 3", "3", "3"),
    ("#### 72 dollars in total", "72", "72"),
    ("#### 72 dollars for 3 people", "72", "3"),
    ("#### 72.", "72", "72"),
    ("#### 18.00", "18", "18"),
    ("#### 2.50", "2.5", "2.5"),
    ("#### -0", "0", "0"),
    ("#### -0.0", "0", "0"),
    ("#### 0.5", "0.5", "0.5"),
    ("#### .5", "0.5", "0.5"),
    ("#### 007", "7", "7"),
    ("#### 1,000,000", "1000000", "1000000"),
    ("#### $-5", "-5", "-5"),
    ("#### -$5", "-5", "-5"),
    ("#### 50%", "50", "50"),
    ("#### 100", "100", "100"),
    ("#### 1e5", None, None),
    ("The answer is 42.", None, "42"),
    ("The answer is 42", None, "42"),
    ("So she has 3 apples and 5 pears, 8 in total.", None, "8"),
    ("First 12, then 1,500 total.", None, "1500"),
    ("It costs $15.", None, "15"),
    ("It costs $1,234.56 in all.", None, "1234.56"),
    ("The temperature is -4 degrees.", None, "-4"),
    ("The discount is 50%.", None, "50"),
    ("He ran 3.75 miles.", None, "3.75"),
    ("5 - 3 = 2", None, "2"),
    ("x-3", None, "3"),
    ("The answer is 12 (see step2)", None, "12"),
    ("abc123def", None, None),
    ("It is the 3rd item", None, None),
    ("pi is about 3.14abc", None, None),
    ("1,2,3", None, "3"),
    ("Answer: 18.00", None, "18"),
    ("The #### marker is missing a number", None, None),
    ("#### The answer is 5", None, "5"),
    ("", None, None),
    ("no numbers here at all", None, None),
    ("####", None, None),
]


@pytest.mark.parametrize("text,strict,flexible", GSM8K_CASES)
def test_extract_gsm8k_answer(text, strict, flexible):
    assert extract_gsm8k_answer(text) == strict
    assert extract_gsm8k_answer(text, mode="strict") == strict
    assert extract_gsm8k_answer(text, mode="flexible") == flexible


# (a short chat answer, strict: the number it ends with, flexible: its last number)
FINAL_NUMBER_CASES = [
    ("72", "72", "72"),
    ("  72 \n", "72", "72"),
    ("72.", "72", "72"),
    ("12 + 60 = 72", "72", "72"),
    ("The answer is **72**.", "72", "72"),
    ("The sum of 12 and 60 is 72.", "72", "72"),
    ("72 is the sum", None, "72"),  # ends with words: strict refuses
    ("The answer is 72!", None, "72"),
    ("-5", "-5", "-5"),
    ("1,234", "1234", "1234"),
    ("7.50", "7.5", "7.5"),
    ("24 + 48 = 100", "100", "100"),  # the wrong sum SmolLM2 writes: it is the answer either way
    ("seventy-two", None, None),
    ("", None, None),
    ("x2", None, None),  # glued to a letter: not a number
]


@pytest.mark.parametrize("text,strict,flexible", FINAL_NUMBER_CASES)
def test_extract_final_number(text, strict, flexible):
    assert extract_final_number(text) == strict
    assert extract_final_number(text, mode="strict") == strict
    assert extract_final_number(text, mode="flexible") == flexible


def test_extract_final_number_unknown_mode():
    with pytest.raises(ValueError, match="answer_mode"):
        extract_final_number("1", mode="lenient")


def test_extract_gsm8k_unknown_mode():
    with pytest.raises(ValueError, match=r"task\.answer_mode.*strict.*flexible"):
        extract_gsm8k_answer("#### 1", mode="lenient")
    with pytest.raises(ValueError, match=r"task\.answer_mode"):
        gsm8k_reward("#### 1", "1", mode="lenient")


@pytest.mark.parametrize(
    "field,expected",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("... #### 1,000", "1000"),
        ("#### 18.00", "18"),
        ("#### -3", "-3"),
        ("42", "42"),
        ("1,000", "1000"),
    ],
)
def test_gsm8k_reference(field, expected):
    assert gsm8k_reference(field) == expected


def test_gsm8k_reference_without_answer_raises():
    with pytest.raises(ValueError, match="####"):
        gsm8k_reference("no answer here")


@pytest.mark.parametrize(
    "completion,reference,kwargs,expected",
    [
        ("3 * 24 = 72\n#### 72", "72", {}, 1.0),
        ("#### 72", "#### 72", {}, 1.0),
        ("#### 1000", "... #### 1,000", {}, 1.0),
        ("#### 1,000", "1000", {}, 1.0),
        ("#### 18", "18.0", {}, 1.0),
        ("#### 18.00", "18", {}, 1.0),
        ("#### $72", "72", {}, 1.0),
        ("#### 71", "72", {}, 0.0),
        ("#### 71", "72", {"format_score": 0.1}, 0.1),
        ("The answer is 72", "72", {"format_score": 0.1}, 0.0),
        ("The answer is 72", "72", {"mode": "flexible", "format_score": 0.1}, 1.0),
        ("The answer is 71", "72", {"mode": "flexible", "format_score": 0.1}, 0.1),
        ("", "72", {"format_score": 0.1}, 0.0),
        ("#### 72", "72", {"correct_score": 2.5}, 2.5),
        ("#### -0", "0", {}, 1.0),
    ],
)
def test_gsm8k_reward(completion, reference, kwargs, expected):
    assert gsm8k_reward(completion, reference, **kwargs) == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------------------------------------

BOXED_CASES = [
    (r"The answer is \boxed{5}.", "5"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
    (r"So $x = \boxed{\{1, 2\}}$", r"\{1, 2\}"),
    (r"First \boxed{1}, then actually \boxed{2}", "2"),
    (r"\boxed{a} \fbox{b}", "b"),
    (r"\fbox{7}", "7"),
    (r"The answer is $\boxed 5$.", "5"),
    (r"The answer is \boxed 5", "5"),
    (r"\boxed{(-\infty, 3]}", r"(-\infty, 3]"),
    (r"\boxed {12}", "12"),
    (r"\boxed{}", ""),
    (r"\boxed{\frac{1}{2}", None),
    (r"\boxed{1} and then \boxed{\frac{1}{2}", None),
    ("no box here", None),
    ("", None),
    (r"\boxed", None),
    (r"\boxedx{3}", None),
]


@pytest.mark.parametrize("text,expected", BOXED_CASES)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


NORMALIZE_CASES = [
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    (r"\tfrac{1}{2}", r"\frac{1}{2}"),
    (r"\frac12", r"\frac{1}{2}"),
    (r"\frac 1 2", r"\frac{1}{2}"),
    (r"\frac{\sqrt2}{2}", r"\frac{\sqrt{2}}{2}"),
    (r"\frac\pi2", r"\frac{\pi}{2}"),
    (r"\sqrt[3]8", r"\sqrt[3]{8}"),
    (r"10\text{ cm}", "10"),
    (r"10 \text{cm}^2", "10"),
    (r"\frac{1}{2}\mbox{ m}", r"\frac{1}{2}"),
    (r"(3\text{ cm}, 4\text{ cm})", "(3,4)"),
    (r"2 \text{ or } 3", "2or3"),
    (r"\text{(A)}", "(A)"),
    (r"\text{Monday}", "Monday"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    ("90°", "90"),
    (r"50\%", "50"),
    ("50%", "50"),
    ("5.", "5"),
    ("0.5", "0.5"),
    (".5", "0.5"),
    ("x=3", "3"),
    ("k = 3", "3"),
    (r"\theta = \frac{\pi}{4}", r"\frac{\pi}{4}"),
    ("x_1 = 2", "2"),
    ("y=2x+1", "2x+1"),
    ("x=1, y=2", "x=1,y=2"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"$\displaystyle \frac{1}{2}$", r"\frac{1}{2}"),
    (r"1\!000", "1000"),
    (r"1\,000", "1000"),
    (r"\$5", "5"),
    (r"  \pi r^2  ", r"\pi r^2"),
    (r"-\frac{3}{4}", r"-\frac{3}{4}"),
]


@pytest.mark.parametrize("raw,expected", NORMALIZE_CASES)
def test_normalize_math_answer(raw, expected):
    assert normalize_math_answer(raw) == expected


EQUAL_CASES = [
    (r"\frac{1}{2}", "1/2"),
    (r"\frac{1}{2}", "0.5"),
    (r"\frac{1}{2}", r"\dfrac{1}{2}"),
    (r"\frac{1}{2}", r"\frac12"),
    ("1/2", "0.5"),
    ("0.5", r"\dfrac{1}{2}"),
    (r"\frac12", "1/2"),
    (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}"),
    (r"10\text{ cm}", "10"),
    (r"90^\circ", "90"),
    ("(1,2)", "(1, 2)"),
    ("x=3", "3"),
    (r"-\frac{3}{4}", "-0.75"),
    (r"\frac{-3}{4}", r"-\frac34"),
    (r"\frac{\pi}{2}", r"\pi/2"),
    (r"2\pi", r"\pi \cdot 2"),
    (r"[1,2)", "[1, 2)"),
    (r"(-\infty,3]", r"(-\infty, 3]"),
    (r"\{1,2\}", r"\{2,1\}"),
    (r"\left(1,2\right)", "(1,2)"),
    ("50\\%", "50"),
    ("$5$", "5"),
]

NOT_EQUAL_CASES = [
    ("1/3", "0.33"),
    ("2", "3"),
    (r"\frac{1}{2}", r"\frac{1}{3}"),
    (r"\frac{3}{4}", r"-\frac{3}{4}"),
    ("(1,2)", "[1,2)"),
    (r"\pi", "3.14"),
    ("", "0"),
    ("", ""),
    (r"\frac{1}{2", r"\frac{1}{2}"),
]


@pytest.mark.parametrize("a,b", EQUAL_CASES)
def test_math_answers_equal(a, b):
    assert math_answers_equal(a, b) is True
    assert math_answers_equal(b, a) is True


@pytest.mark.parametrize("a,b", NOT_EQUAL_CASES)
def test_math_answers_not_equal(a, b):
    assert math_answers_equal(a, b) is False
    assert math_answers_equal(b, a) is False


def test_math_answers_equal_outside_main_thread():
    results = {}

    def work():
        results["eq"] = math_answers_equal("0.5", r"\frac{1}{2}")
        results["ne"] = math_answers_equal("1/3", "0.33")

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=30)
    assert results == {"eq": True, "ne": False}


SOLUTION = r"We compute $\frac{2}{4} = \boxed{\frac{1}{2}}$."


@pytest.mark.parametrize(
    "completion,reference,kwargs,expected",
    [
        (r"so the answer is $\boxed{\frac12}$", r"\frac{1}{2}", {}, 1.0),
        (r"so the answer is $\boxed{0.5}$", SOLUTION, {}, 1.0),
        (r"\boxed{1} no wait \boxed{\dfrac{1}{2}}", SOLUTION, {}, 1.0),
        (r"\boxed{\frac{1}{3}}", SOLUTION, {}, 0.0),
        (r"\boxed{\frac{1}{3}}", SOLUTION, {"format_score": 0.1}, 0.1),
        (r"the answer is 1/2", SOLUTION, {"format_score": 0.1}, 0.0),
        (r"\boxed{\frac{1}{2}", SOLUTION, {"format_score": 0.1}, 0.0),
        (r"\boxed{10\text{ cm}}", "10", {}, 1.0),
        (r"\boxed 5", "5", {"correct_score": 2.0}, 2.0),
        (r"\boxed{x=3}", r"The root is $\boxed{3}$.", {}, 1.0),
    ],
)
def test_math_reward(completion, reference, kwargs, expected):
    assert math_reward(completion, reference, **kwargs) == pytest.approx(expected)
