"""Backend strings ``"<engine>:d<X>[t<T>][p<P>]"``: the engine names, ``Backend`` and ``parse_backend``."""

import difflib
import re
from typing import Any, NamedTuple, Optional

from stalerl.config.errors import ConfigError


# --------------------------------------------------------------------------------------------------------------------
# Backend strings: "<engine>:d<X>[t<T>][p<P>]"
# --------------------------------------------------------------------------------------------------------------------

# "auto": vllm when vLLM is importable at a supported version, else hf; resolved once when the run starts
# (stalerl.config.rules.resolve_rollout_backend), so everything after start-up sees hf or vllm.
ROLLOUT_ENGINES = ("hf", "vllm", "sglang", "auto")
TRAIN_ENGINES = ("torch", "fsdp")
_GPU_ROLLOUT_ENGINES = ("vllm", "sglang")


class Backend(NamedTuple):
    """A parsed backend string: engine name and data / tensor / pipeline parallel sizes."""

    engine: str
    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        """Processes (or GPUs, for GPU engines) the backend needs: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        s = f"{self.engine}:d{self.dp}"
        if self.tp != 1:
            s += f"t{self.tp}"
        if self.pp != 1:
            s += f"p{self.pp}"
        return s


_DIM_NAMES = {"d": "data-parallel replicas", "t": "tensor-parallel size", "p": "pipeline stages"}


def parse_backend(s: str, *, engines: Optional[tuple] = None, key: str = "backend") -> Backend:
    """Parse ``"<engine>:d<X>[t<T>][p<P>]"`` (dimensions in any order, each at most once, ``d`` required).

    ``parse_backend("sglang:d2t2") == Backend("sglang", dp=2, tp=2, pp=1)``. ``engines`` restricts the engine names;
    ``key`` is the dotted key named in errors. Raises :class:`ConfigError` with the expected grammar.
    """
    grammar = "'<engine>:d<X>[t<T>][p<P>]', e.g. 'sglang:d2', 'vllm:d1t2', 'torch:d1'"
    engine_hint = f" with engine one of {', '.join(engines)}" if engines else ""

    def fail(why: str) -> ConfigError:
        detail = (f"got {s!r}: {why}. Expected {grammar}{engine_hint}. "
                  f"Fix: use e.g. {(engines or ('hf',))[0]}:d1.")
        err = ConfigError(f"invalid {key}: {detail}", [key])
        err.detail = detail  # type: ignore[attr-defined]
        return err

    if not isinstance(s, str):
        raise fail(f"must be a string, got {type(s).__name__}")
    if "+" in s:
        raise fail("combined allocation strings with '+' are not supported; set rollout.backend and actor.backend "
                   "separately")
    engine, sep, dims = s.strip().partition(":")
    engine = engine.strip().lower()
    if not sep or not engine:
        raise fail("missing '<engine>:' prefix")
    if engines is not None and engine not in engines:
        close = difflib.get_close_matches(engine, engines, n=1)
        raise fail(f"unknown engine {engine!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if not dims:
        raise fail("missing parallel dimensions after ':'")
    pos, sizes = 0, {}
    for m in re.finditer(r"([a-zA-Z])(\d*)", dims):
        if m.start() != pos:
            break
        letter, digits = m.group(1).lower(), m.group(2)
        if letter not in _DIM_NAMES:
            raise fail(f"unknown dimension {m.group(1)!r} (known: d = data-parallel, t = tensor-parallel, "
                       "p = pipeline)")
        if not digits:
            raise fail(f"dimension {letter!r} needs a size, e.g. {letter}2")
        if letter in sizes:
            raise fail(f"dimension {letter!r} given twice")
        size = int(digits)
        if size < 1:
            raise fail(f"{_DIM_NAMES[letter]} must be >= 1, got {size}")
        sizes[letter] = size
        pos = m.end()
    if pos != len(dims):
        raise fail(f"cannot parse {dims[pos:]!r}")
    if "d" not in sizes:
        raise fail("the data-parallel size 'd<X>' is required")
    return Backend(engine, sizes["d"], sizes.get("t", 1), sizes.get("p", 1))


def is_async(cfg: Any) -> bool:
    """Whether the run uses separate rollout and train workers (see rollout.mode). Here, beside the backend strings it
    reads, so that the config rules and ``stalerl.config.share_gpu`` both import it without a cycle."""
    ro = cfg.rollout
    if ro.mode != "auto":
        return ro.mode == "async"
    if ro.fixed_staleness > 0:
        return False
    rb = parse_backend(ro.backend, engines=ROLLOUT_ENGINES, key="rollout.backend")
    ab = parse_backend(cfg.actor.backend, engines=TRAIN_ENGINES, key="actor.backend")
    return ro.max_head_offpolicyness > 0 or rb.dp > 1 or ab.dp > 1
