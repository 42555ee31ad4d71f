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
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

PolicyLossFn = Callable[..., "tuple[Any, dict[str, float]]"]
BatchSelector = Callable[..., "dict[str, Any]"]

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


_REGISTRY: dict[str, PolicyLossSpec] = {}


def register_policy_loss(name: str, *, batch_selector: Optional[BatchSelector] = None):
    """Decorator: register ``fn`` under ``name``. Registering a different function under a taken name is an error
    (verl's registry silently overwrites, which hides plugin clashes)."""

    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing.fn) != _qualname(fn):
            raise ValueError(
                f"policy loss {name!r} is already registered by {_qualname(existing.fn)}; "
                f"refusing to replace it with {_qualname(fn)}. Pick another name."
            )
        _REGISTRY[name] = PolicyLossSpec(name=name, fn=fn, batch_selector=batch_selector)
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
