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

Every loss carries a :class:`recipe.declaration.LossDeclaration` (its parameters, step needs and metric rules; one
made from the registration when none is given). The built-in declarations are torch-free modules
(:data:`BUILTIN_DECLARATIONS`), so a config is validated without importing torch; a loss from another package is
found through the entry-point group ``recipe.losses`` (:func:`load_plugins`; docs/adding-a-loss.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from recipe.declaration import LossDeclaration

PolicyLossFn = Callable[..., "tuple[Any, dict[str, float]]"]
BatchSelector = Callable[..., "dict[str, Any]"]
RowSelector = Callable[..., "dict[str, Any]"]

# The built-in losses are found, not listed: every package ``recipe/<loss>/`` with a ``declaration.py`` (torch-free:
# ``DECLARATION`` or a tuple ``DECLARATIONS``) and an ``algorithm.py`` that registers the loss when imported (lazily,
# on the first lookup: ``import recipe.registry`` stays torch- and cycle-free). Adding one edits no list here.
_RECIPE_DIR = Path(__file__).resolve().parent
_LOSS_PACKAGES = tuple(sorted(d.name for d in _RECIPE_DIR.iterdir()
                              if (d / "declaration.py").is_file() and (d / "algorithm.py").is_file()))
_BUILTIN_RECIPES = tuple(f"recipe.{name}.algorithm" for name in _LOSS_PACKAGES)
BUILTIN_DECLARATIONS = tuple(f"recipe.{name}.declaration" for name in _LOSS_PACKAGES)
#: The entry-point group of losses from other packages: each entry point names a module that registers its losses.
PLUGIN_GROUP = "recipe.losses"
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
    declaration: Optional[LossDeclaration] = None


_REGISTRY: dict[str, PolicyLossSpec] = {}


def register_policy_loss(name: Union[str, LossDeclaration], *, batch_selector: Optional[BatchSelector] = None,
                         row_selector: Optional[RowSelector] = None):
    """Decorator: register ``fn`` under ``name``, a loss name or its :class:`LossDeclaration`. Registering a
    different function under a taken name is an error (verl's registry silently overwrites, which hides plugin
    clashes). A declaration's ``step`` must match the selector given."""

    declaration = name if isinstance(name, LossDeclaration) else None
    name = declaration.name if declaration is not None else name
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")
    if batch_selector is not None and row_selector is not None:
        raise ValueError(f"policy loss {name!r}: give a batch_selector (one decision over the whole step) or a "
                         "row_selector (one per row), not both")
    step = "batch_selector" if batch_selector is not None else "row_selector" if row_selector is not None else "nothing"
    if declaration is None:  # by name: the loss's declaration if it matches, else a bare one (no parameters)
        declared = _DECLARED.get(name) or declarations(plugins=False).get(name)
        declaration = declared if declared is not None and declared.step == step else \
            LossDeclaration(name=name, summary="(registered without a declaration)", step=step)
    if declaration.step != step:
        raise ValueError(f"policy loss {name!r}: its declaration says step={declaration.step!r} but it is registered "
                         f"with {step.replace('_', ' ') if step != 'nothing' else 'no selector'}; register the "
                         "selector its declaration names")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing.fn) != _qualname(fn):
            raise ValueError(
                f"policy loss {name!r} is already registered by {_qualname(existing.fn)}; "
                f"refusing to replace it with {_qualname(fn)}. Pick another name."
            )
        _REGISTRY[name] = PolicyLossSpec(name=name, fn=fn, batch_selector=batch_selector, row_selector=row_selector,
                                         declaration=declaration)
        _DECLARED[name] = declaration
        return fn

    return decorator


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_DECLARED: dict[str, LossDeclaration] = {}
_PLUGINS_LOADED = False


def _builtin_declarations() -> tuple[LossDeclaration, ...]:
    out = []
    for name in BUILTIN_DECLARATIONS:
        module = importlib.import_module(name)
        value = getattr(module, "DECLARATIONS", None) or (module.DECLARATION,)
        out.extend(value)
    return tuple(out)


def load_plugins() -> list[str]:
    """Import the modules of the ``recipe.losses`` entry points once (each registers its losses); their names."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return []
    _PLUGINS_LOADED = True
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            importlib.import_module(ep.value.split(":")[0])
        except Exception as exc:  # noqa: BLE001 - name the plugin; a broken one must not look like a typo
            raise ImportError(f"the policy-loss plugin {ep.name!r} ({ep.value}, entry-point group {PLUGIN_GROUP!r}) "
                              f"failed to import: {type(exc).__name__}: {exc}. Fix the plugin or uninstall it.") from exc
        loaded.append(ep.name)
    return loaded


def _load_builtins() -> None:
    for module in _BUILTIN_RECIPES:
        importlib.import_module(module)
    load_plugins()


def declarations(*, plugins: bool = True) -> dict[str, LossDeclaration]:
    """Every loss's declaration by name: the built-ins (torch-free), then (``plugins``) the entry-point losses and
    any registered at run time."""
    out = {d.name: d for d in _builtin_declarations()}
    if plugins:
        load_plugins()
    for name, decl in _DECLARED.items():
        out.setdefault(name, decl)
    return out


def get_declaration(name: str) -> LossDeclaration:
    """The declaration of loss ``name``; a built-in answers without importing torch."""
    found = declarations(plugins=False).get(name) or declarations().get(name)
    if found is None:
        return get_policy_loss_spec(name).declaration  # raises, listing the registered losses
    return found


# The built-in names, torch-free (a unit test keeps them in step with what the modules register).
BUILTIN_POLICY_LOSSES = tuple(sorted(d.name for d in _builtin_declarations()))


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

