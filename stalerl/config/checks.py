"""Value checks: one field's type, choices and bounds, problem formatting and the walk over a config's sections."""

import dataclasses
import difflib
import math
import typing
from functools import lru_cache
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union


@lru_cache(maxsize=None)
def _type_hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) in (list, List):
        (arg,) = typing.get_args(inner) or (Any,)
        name = f"a list of {getattr(arg, '__name__', str(arg))}"
    elif dataclasses.is_dataclass(inner):
        name = f"a {inner.__name__} mapping"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _check_value(key: str, value: Any, tp: Any, metadata: Any) -> Optional[str]:
    """A problem message for one field value, or None."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        return f"got null; expected {_type_name(tp)}. Fix: set {key} to a value (null is not allowed here)."
    if _is_interpolation(value) and inner is not str:
        return None  # unresolved (direct Python construction); ExperimentConfig resolves and re-checks
    param = metadata.get("param")
    if param is not None:  # a loss parameter: its declaration's Param.check is the one validation
        try:
            param.check(value, key)
        except ValueError as err:
            message = str(err)
            return message[len(key) + 1:] if message.startswith(f"{key} ") else message
        return None
    ok = True
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            return f"got {value!r}; expected a finite number. Fix: set {key} to a finite value."
    elif inner is str:
        ok = isinstance(value, str)
    elif typing.get_origin(inner) in (list, List):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif dataclasses.is_dataclass(inner):
        ok = isinstance(value, inner)
    if not ok:
        return f"got {value!r} ({type(value).__name__}); expected {_type_name(tp)}."
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        allowed = ", ".join(choices) + (", null" if optional else "")
        return (f"got {value!r}; expected one of {allowed}{_did_you_mean(str(value), choices)}. "
                f"Fix: set {key}={_fix_value(str(value), choices, choices[0])}.")
    for name, op, words in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                            ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = metadata.get(name)
        if bound is not None and not op(value, bound):
            return f"got {value!r}; expected {words} {bound}. Fix: set {key} to a value {words} {bound}."
    return None


def _closest(word: str, candidates: Any) -> Optional[str]:
    """The candidate ``word`` most likely misspells (difflib, ratio >= 0.6), or None."""
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    return close[0] if close else None


def _did_you_mean(word: str, candidates: Any) -> str:
    close = _closest(word, candidates)
    return f" (did you mean {close!r}?)" if close else ""


def _fix_value(word: str, candidates: Any, default: Any) -> Any:
    """The value a Fix line names: the suggested spelling when there is one (so the line does not say "did you
    mean 'm2po'?" and then "set actor.loss=fipo"), else ``default``."""
    close = _closest(word, candidates)
    return close if close is not None else default


def _format_problems(problems: List[Tuple[str, str]]) -> str:
    if len(problems) == 1:
        key, msg = problems[0]
        return f"invalid config: {key}: {msg}"
    lines = [f"invalid config ({len(problems)} problems):"]
    lines += [f"  - {msg}" if msg.startswith("unknown config key") else f"  - {key}: {msg}" for key, msg in problems]
    return "\n".join(lines)


def _walk_sections(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted prefix, section) for every dataclass section in the tree, parents first."""
    yield prefix, node
    for f in dataclasses.fields(node):
        child = getattr(node, f.name)
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            yield from _walk_sections(child, f"{prefix}.{f.name}" if prefix else f.name)
