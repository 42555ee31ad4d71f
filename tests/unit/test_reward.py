"""stalerl.core.reward: answer extraction, numeric comparison, the GSM8K reward."""

import time

import pytest

from stalerl.core import reward as reward_mod
from stalerl.core.reward import extract_answer, extract_reference, gsm8k_reward, normalize_number, numbers_equal


@pytest.mark.parametrize(
    "text, expected",
    [
        # #### N: the first #### followed by a number
        ("#### 58", "58"),
        (" #### 58", "58"),
        ("####58", "58"),
        ("36+13=49. 49-20=29. #### 29", "29"),
        ("#### 12 and later #### 13", "12"),
        ("#### -7", "-7"),
        ("#### 1,600", "1600"),
        ("#### $1,600.00", "1600"),
        ("#### 3.50", "3.5"),
        ("#### 72.", "72"),
        ("#### 007", "7"),
        ("#### -0", "0"),
        ("#### 3/4", "3/4"),
        ("#### x then 5 apples", "5"),  # no number right after ####: falls back to the last number
        # \boxed{...}: the last one, nested braces, LaTeX clean-up
        ("\\boxed{72}", "72"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{72.0}", "72"),
        ("\\boxed{\\frac{3}{4}}", "3/4"),
        ("\\boxed{\\dfrac{1}{2}}", "1/2"),
        ("\\boxed{1{,}000}", "1000"),
        ("\\boxed{\\$18}", "18"),
        ("\\boxed{18 \\text{ dollars}}", "18"),
        ("\\boxed{\\boxed{3}}", "3"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed 5", "5"),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("The answer is $\\boxed{-12}$.", "-12"),
        # last number
        ("The answer is 72", "72"),
        ("The answer is $1,234.50.", "1234.5"),
        ("it costs -$5", "-5"),
        ("it costs $-5", "-5"),
        ("So 49-20", "20"),  # a minus between numbers is not a sign
        ("x-5", "5"),
        ("temperature is -4 degrees", "-4"),
        ("1,234,567 apples", "1234567"),
        ("12,3456", "3456"),
        ("1,2,3", "3"),
        ("3/4 cup", "3/4"),
        ("She had 5 apples; 58.", "58"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_reference():
    assert extract_reference("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_reference("#### 1,600") == "1600"
    assert extract_reference("72") == "72"
    assert extract_reference("x^2") == "x^2"


@pytest.mark.parametrize("text, expected", [("$1,234.50", "1234.5"), ("58.", "58"), ("-0.0", "0"), (" 3/4 ", "3/4"),
                                            ("0.50", "0.5"), ("12 apples", None), ("", None), ("abc", None)])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_numbers_equal():
    assert numbers_equal("72", "72.0")
    assert numbers_equal("1,000", 1000)
    assert numbers_equal("3/4", "0.75")
    assert numbers_equal(1e9, 1e9 + 1)  # within 1e-6 relative
    assert not numbers_equal(1e3, 1e3 + 1)
    assert not numbers_equal("72", "73")
    assert not numbers_equal("72", "-72")
    assert not numbers_equal("x", "x")  # not numbers
    assert not numbers_equal(None, "1")
    assert not numbers_equal("1/0", "1/0")
    assert numbers_equal("0", "-0")


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (" #### 58", "#### 58", 1.0),
        (" #### 58", "58", 1.0),
        (" #### 5", "#### 58", 0.0),
        (" #### 580", "#### 58", 0.0),
        (" #### 85", "#### 58", 0.0),
        ("36+13=49. 49-20=29. #### 29", "36+13=49. 49-20=29. #### 29", 1.0),
        ("36+13=49. 49-20=29. #### 49", "36+13=49. 49-20=29. #### 29", 0.0),
        ("Natalia sold 24 in May. \\boxed{72}", "Natalia sold... \n#### 72", 1.0),
        ("The answer is 72", "#### 72", 1.0),
        ("\\boxed{72.0}", "#### 72", 1.0),
        ("\\boxed{24}", "#### 72", 0.0),
        ("I don't know", "#### 72", 0.0),
        ("", "#### 72", 0.0),
        (" #### 1,600", "#### 1600", 1.0),
        ("#### $1600.00", "#### 1,600", 1.0),
        (" ####", "#### 0", 0.0),
        ("#### -3", "#### 3", 0.0),
    ],
)
def test_gsm8k_reward(completion, answer, expected):
    assert gsm8k_reward(completion, answer) == expected


def test_reward_non_numeric_without_math_verify(monkeypatch):
    monkeypatch.setattr(reward_mod, "_MATH_VERIFY", False)  # as if not installed
    assert gsm8k_reward("\\boxed{\\sqrt{2}}", "\\sqrt{2}") == 1.0
    assert gsm8k_reward("\\boxed{\\sqrt{3}}", "\\sqrt{2}") == 0.0


def test_reward_uses_math_verify_when_available(monkeypatch):
    calls = []

    class FakeMathVerify:
        @staticmethod
        def parse(text, **kwargs):
            calls.append(text)
            return [text]

        @staticmethod
        def verify(gold, pred, **kwargs):
            return True

    monkeypatch.setattr(reward_mod, "_MATH_VERIFY", FakeMathVerify)
    assert gsm8k_reward("\\boxed{2^{1/2}}", "\\sqrt{2}") == 1.0
    assert calls  # consulted for non-numeric answers
    calls.clear()
    assert gsm8k_reward(" #### 5", "#### 58") == 0.0  # numeric answers never reach it
    assert calls == []


def test_reward_is_fast():
    completions = [" #### 58", "36+13=49. 49-20=29. #### 29", "The answer is \\boxed{1,234}.", "no number"] * 500
    start = time.perf_counter()
    for c in completions:
        gsm8k_reward(c, "#### 58")
    per_call = (time.perf_counter() - start) / len(completions)
    assert per_call < 200e-6, per_call
