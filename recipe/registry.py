"""The policy-loss registry: every stale-rollout loss of this project, by name, behind verl's signature.

A registered loss is called as::

    loss, metrics = fn(old_log_prob=..., log_prob=..., advantages=..., response_mask=...,
                       loss_agg_mode="token-mean", config=cfg, rollout_is_weights=None)

- ``log_prob - old_log_prob`` is log(pi_theta / pi_behaviour) per token; tensors are (batch, response_len).
- ``loss`` is a scalar tensor with grad; ``metrics`` is a dict of Python floats with the same keys on every call
  (verl aggregates metrics across micro-batches and ranks and refuses keys that come and go).

Some losses make a decision over a whole optimizer mini-batch (M2PO's token selection). Such a loss registers a
``batch_selector`` beside it: ``selector(old_log_prob, log_prob, advantages, response_mask, config=..., group=None)``
returns a dict of extra keyword tensors (same shape as the inputs) that the runtime slices per micro-batch and passes
back to the loss. Callers that never use the selector (verl) still get a correct loss, selected per call.

A loss whose decision is per row (FIPO's sequence drop; rows never span micro-batches) registers a ``row_selector``
instead: ``selector(old_log_prob, log_prob, advantages, response_mask, config=..., cu_seqlens=None)`` on *one*
micro-batch (``(B, T)`` rows, or packed tokens with their ``cu_seqlens``) returns ``{"row_keep_mask": <the input's
shape>, "num_rows": int, "num_dropped_rows": int}``; ``recipe.optimizer_batch.plan_optimizer_batch`` calls it per
micro-batch, passes ``row_keep_mask`` back to the loss and counts only the kept tokens in the step's denominator.
Either kind needs the step's current log-probs before the first micro-batch's loss: :func:`needs_step_log_probs`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

PolicyLossFn = Callable[..., "tuple[Any, dict[str, float]]"]
BatchSelector = Callable[..., "dict[str, Any]"]
RowSelector = Callable[..., "dict[str, Any]"]

# Modules that register the built-in losses. Imported lazily on first lookup so that
# `import recipe.registry` stays import-cycle free (the recipes import this module).
_BUILTIN_RECIPES = ("recipe.m2po", "recipe.baselines", "recipe.fipo", "recipe.m2po_authors")
# The names those modules register, so a config can be validated without importing torch (a unit test keeps this in
# step with what the modules really register).
BUILTIN_POLICY_LOSSES = ("fipo", "m2po", "m2po_authors", "no_trust_region", "vanilla")
# verl's loss aggregation modes (recipe.common implements them; listed here, torch-free, for config validation).
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    fn: PolicyLossFn
    batch_selector: Optional[BatchSelector] = None
    row_selector: Optional[RowSelector] = None


_REGISTRY: dict[str, PolicyLossSpec] = {}


def register_policy_loss(name: str, *, batch_selector: Optional[BatchSelector] = None,
                         row_selector: Optional[RowSelector] = None):
    """Decorator: register ``fn`` under ``name``. Registering a different function under a taken name is an error
    (verl's registry silently overwrites, which hides plugin clashes)."""

    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")
    if batch_selector is not None and row_selector is not None:
        raise ValueError(f"policy loss {name!r}: give a batch_selector (one decision over the whole step) or a "
                         "row_selector (one per row), not both")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing.fn) != _qualname(fn):
            raise ValueError(
                f"policy loss {name!r} is already registered by {_qualname(existing.fn)}; "
                f"refusing to replace it with {_qualname(fn)}. Pick another name."
            )
        _REGISTRY[name] = PolicyLossSpec(name=name, fn=fn, batch_selector=batch_selector, row_selector=row_selector)
        return fn

    return decorator


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _load_builtins() -> None:
    for module in _BUILTIN_RECIPES:
        importlib.import_module(module)


def is_policy_loss_registered(name: str) -> bool:
    """Whether ``name`` is a registered loss; a built-in name answers without importing torch."""
    return name in _REGISTRY or name in BUILTIN_POLICY_LOSSES or name in registered_policy_losses()


def registered_policy_losses() -> list[str]:
    """Names of all registered losses, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_policy_loss_spec(name: str) -> PolicyLossSpec:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r}; registered losses are: {', '.join(sorted(_REGISTRY))}. "
            "Set actor.loss (or policy_loss.loss_mode in verl) to one of these, or register yours with "
            "recipe.registry.register_policy_loss."
        ) from None


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered under ``name``; an unknown name raises ValueError listing the registered names."""
    return get_policy_loss_spec(name).fn


def get_batch_selector(name: str) -> Optional[BatchSelector]:
    """The mini-batch selector registered with loss ``name``, or None if the loss needs none."""
    return get_policy_loss_spec(name).batch_selector


def get_row_selector(name: str) -> Optional[RowSelector]:
    """The per-row selector registered with loss ``name`` (FIPO's sequence drop), or None."""
    return get_policy_loss_spec(name).row_selector


def needs_step_log_probs(name: str) -> bool:
    """Whether planning a split step of loss ``name`` needs every micro-batch's current log-probs (a batch or a row
    selector decides from them); otherwise the plan needs only the masks (the token count)."""
    spec = get_policy_loss_spec(name)
    return spec.batch_selector is not None or spec.row_selector is not None
