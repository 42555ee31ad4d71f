"""Config errors and warnings, and the switch that defers per-section checks while OmegaConf builds a config."""

import contextlib
import contextvars
from typing import Iterator, List, Optional


class ConfigError(ValueError):
    """A configuration problem found at load time. ``keys`` lists the dotted keys involved (may be empty)."""

    def __init__(self, message: str, keys: Optional[List[str]] = None):
        super().__init__(message)
        self.keys = list(keys or [])


class ConfigWarning(UserWarning):
    """A legal but probably unintended setting (e.g. ``gconfig.greedy=true`` for training)."""


# While OmegaConf instantiates the dataclasses, per-section __post_init__ checks are deferred so that `validate`
# can report every problem at once with full dotted keys (``train_dataset.batch_size``, not ``batch_size``).
_DEFER_CHECKS: contextvars.ContextVar = contextvars.ContextVar("stalerl_config_defer_checks", default=False)


@contextlib.contextmanager
def _deferred_checks() -> Iterator[None]:
    token = _DEFER_CHECKS.set(True)
    try:
        yield
    finally:
        _DEFER_CHECKS.reset(token)
