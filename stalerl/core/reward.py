"""GSM8K reward: extract the final answer of a completion and compare it with the reference.

Extraction order (``extract_answer``):

1. ``#### N`` -- the number after the first ``####`` that is followed by one (GSM8K's own format, and the
   format the built-in char-level model is trained on);
2. ``\\boxed{...}`` -- the last one, with nested braces (the "Please put your final answer within \\boxed{}" format of
   chat models); a box holding a single number yields that number, anything else yields its stripped contents;
3. otherwise the last number in the text (AReaL / math_verify behaviour: "last number wins").

Numbers may carry thousands separators (``1,234``), a currency sign (``$5``, ``-$5``), a sign, decimals, a trailing
full stop (``58.``) or be a plain fraction (``3/4``). They are returned in a canonical form: no commas or ``$``,
no trailing zeros after the decimal point (``72.0`` -> ``72``), no ``-0``.

``gsm8k_reward`` compares numbers numerically (relative tolerance 1e-6). When either side is not a number and the
optional ``math_verify`` package is installed it is used as a fallback (imported lazily, never required);
otherwise the fallback is a whitespace- and case-insensitive string comparison. Everything is plain ``re`` work,
a few microseconds per call.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Optional, Union

__all__ = [
    "extract_answer",
    "extract_reference",
    "normalize_number",
    "numbers_equal",
    "gsm8k_reward",
]

# A number as written in text. The sign is only a sign when it does not follow a word character or a closing
# bracket (so "49-20" is 49 and 20, not 49 and -20).
_NUMBER = (
    r"(?:(?<![\w)\]}])[-\u2212])?"  # sign
    r"(?:\\?\$\s?[-\u2212]?)?"  # currency ($ or \$), and the sign of $-5
    r"(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)"  # integer part, optionally with thousands separators
    r"(?:\.\d+)?"  # decimals (a trailing "." is not part of the number)
    r"(?:/\d+(?:\.\d+)?)?"  # a plain fraction 3/4
)
_NUMBER_RE = re.compile(_NUMBER)
_FULL_NUMBER_RE = re.compile(r"\s*(" + _NUMBER + r")\s*\.?\s*")
_HASHES_RE = re.compile(r"####\s*(?:\\\(\s*)?(" + _NUMBER + r")")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")

# LaTeX clean-up applied to the contents of a box before looking for a number.
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([-\d.,]+)\s*\}\s*\{\s*([-\d.,]+)\s*\}")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{[^{}]*\}")
_LATEX_DROP = ("\\$", "\\%", "%", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\left", "\\right", "$")


def normalize_number(text: str) -> Optional[str]:
    """Canonical form of a number written as text, or None when ``text`` is not (just) a number.

    ``"$1,234.50"`` -> ``"1234.5"``, ``"58."`` -> ``"58"``, ``"-0"`` -> ``"0"``, ``"3/4"`` -> ``"3/4"``.
    """
    m = _FULL_NUMBER_RE.fullmatch(text)
    if m is None:
        return None
    return _canonical(m.group(1))


def _canonical(raw: str) -> str:
    s = raw.replace("\u2212", "-").replace("\\$", "").replace("$", "").replace(",", "")
    s = "".join(s.split())
    negative = s.count("-") % 2 == 1
    s = s.replace("-", "")
    if "/" in s:
        num, den = s.split("/", 1)
        num, den = _strip_zeros(num), _strip_zeros(den)
        out = f"{num}/{den}"
        zero = num == "0"
    else:
        out = _strip_zeros(s)
        zero = out == "0"
    return "-" + out if negative and not zero else out


def _strip_zeros(s: str) -> str:
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    s = s.lstrip("0")
    if not s or s.startswith("."):
        s = "0" + s
    return s


def _last_boxed(text: str) -> Optional[str]:
    """Contents of the last ``\\boxed{...}`` (balanced braces) or ``\\boxed N``; None when there is none."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                c = text[i]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : i]
            continue  # unbalanced: try an earlier box
        m = re.match(r"[^\s$]+", text[start:])
        if m:
            return m.group(0)
    return None


def _clean_boxed(content: str) -> str:
    s = content.replace("{,}", ",")
    s = _LATEX_FRAC_RE.sub(r"\1/\2", s)
    s = _LATEX_TEXT_RE.sub(" ", s)
    for tok in _LATEX_DROP:
        s = s.replace(tok, "")
    return s.strip()


def extract_answer(text: str) -> Optional[str]:
    """The final answer written in ``text`` (see the module docstring), or None when there is none."""
    if not text:
        return None
    if "####" in text:
        m = _HASHES_RE.search(text)
        if m:
            return _canonical(m.group(1))
    if "\\boxed" in text or "\\fbox" in text:
        content = _last_boxed(text)
        if content is not None:
            cleaned = _clean_boxed(content)
            num = normalize_number(cleaned)
            if num is not None:
                return num
            if not any(c in cleaned for c in "\\^_"):
                nums = _NUMBER_RE.findall(cleaned)
                if len(nums) == 1:
                    return _canonical(nums[0])
            if cleaned:
                return cleaned
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    return _canonical(last.group(0)) if last is not None else None


def extract_reference(answer: str) -> str:
    """The reference final answer from a GSM8K answer (``... #### N``) or from a bare final answer (``N``)."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    answer = answer.strip()
    num = normalize_number(answer)
    return num if num is not None else answer


def _to_float(x: Union[str, int, float, Fraction, None]) -> Optional[float]:
    if x is None:
        return None
    if isinstance(x, (int, float, Fraction)) and not isinstance(x, bool):
        return float(x)
    s = normalize_number(str(x))
    if s is None:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return float(Fraction(num) / Fraction(den))  # Fraction(0) denominator raises
        return float(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def numbers_equal(a, b, rel_tol: float = 1e-6) -> bool:
    """True when ``a`` and ``b`` are numbers (or numeric strings, see ``normalize_number``) equal within ``rel_tol``.

    Anything that is not a number compares unequal.
    """
    x, y = _to_float(a), _to_float(b)
    if x is None or y is None or math.isnan(x) or math.isnan(y):
        return False
    return math.isclose(x, y, rel_tol=rel_tol, abs_tol=0.0)


_MATH_VERIFY = None  # None: not tried yet; False: not installed; else the module


def _math_verify():
    global _MATH_VERIFY
    if _MATH_VERIFY is None:
        try:
            import math_verify  # type: ignore

            _MATH_VERIFY = math_verify
        except Exception:  # ImportError, or a broken install
            _MATH_VERIFY = False
    return _MATH_VERIFY or None


def _math_verify_equal(mv, completion: str, reference: str) -> Optional[bool]:
    """math_verify's verdict, or None when it could not give one. Signal-based timeouts are switched off where the
    installed version allows it (they only work in the main thread)."""
    try:
        try:
            gold = mv.parse("\\boxed{" + reference + "}", parsing_timeout=None)
            pred = mv.parse(completion, parsing_timeout=None)
        except TypeError:
            gold = mv.parse("\\boxed{" + reference + "}")
            pred = mv.parse(completion)
        if not gold or not pred:
            return None
        try:
            return bool(mv.verify(gold, pred, timeout_seconds=None))
        except TypeError:
            return bool(mv.verify(gold, pred))
    except Exception:
        return None


def _loose(s: str) -> str:
    return "".join(s.split()).lower().rstrip(".")


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 when the final answer of ``completion`` equals the reference, else 0.0.

    ``answer`` is either the GSM8K worked answer ending in ``#### N`` or the bare final answer ``N``.
    """
    reference = extract_reference(answer)
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    ref_num = _to_float(reference)
    pred_num = _to_float(pred)
    if ref_num is not None and pred_num is not None:
        return 1.0 if numbers_equal(pred_num, ref_num) else 0.0
    mv = _math_verify()
    if mv is not None:
        verdict = _math_verify_equal(mv, completion, reference)
        if verdict is not None:
            return 1.0 if verdict else 0.0
    return 1.0 if _loose(pred) == _loose(reference) else 0.0
