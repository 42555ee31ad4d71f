"""The ``_f`` field helper (help, choices, bounds) and ``_Section``, the base that runs a section's checks."""

import dataclasses
from dataclasses import field
from typing import Any, Dict, List, Optional, Tuple

from stalerl.config.checks import _check_value, _format_problems, _type_hints
from stalerl.config.errors import _DEFER_CHECKS, ConfigError


def _f(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None, choices: Optional[tuple] = None,
       ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
       lt: Optional[float] = None) -> Any:
    """``dataclasses.field`` with ``metadata={"help": ..., "choices": ..., "ge"/"gt"/"le"/"lt": ...}``."""
    metadata: Dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    for name, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)):
        if bound is not None:
            metadata[name] = bound
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class _Section:
    """Base of every config section: declarative checks (type, choices, bounds) plus ``_check`` for the rest."""

    def __post_init__(self) -> None:
        if _DEFER_CHECKS.get():
            return
        problems = self._problems(type(self).__name__)
        if problems:
            raise ConfigError(_format_problems(problems), [p[0] for p in problems])

    def _problems(self, prefix: str) -> List[Tuple[str, str]]:
        """Problems of this section only (not of nested sections) as (key, message) pairs."""
        out: List[Tuple[str, str]] = []
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            key = f"{prefix}.{f.name}" if prefix else f.name
            msg = _check_value(key, getattr(self, f.name), hints[f.name], f.metadata)
            if msg:
                out.append((key, msg))
        if not out:  # custom checks assume well-typed values
            for key, msg in self._check():
                out.append((f"{prefix}.{key}" if prefix else key, msg))
        return out

    def _check(self) -> List[Tuple[str, str]]:
        """Section-specific checks; keys relative to the section."""
        return []
