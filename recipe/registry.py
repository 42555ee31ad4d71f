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

Isolation: a plugin that fails to import, or declares a loss (or a parameter) that clashes with another, is refused
*alone*, with one logged line naming it, the clash and the fix (:func:`refusals`); every other loss still registers.
A framework adapter asks :func:`usable_declarations` for the losses it can offer: the one clash check against that
framework's own loss names and config fields. The registry's whole state is one object (:func:`snapshot`,
:func:`restore`: what a test fixture saves and puts back).
"""

from __future__ import annotations

import copy
import importlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from recipe.declaration import PPO_CLIP, LossDeclaration

logger = logging.getLogger(__name__)

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
#: The entry-point group of losses from other packages: each entry point names a module holding ``DECLARATION`` (or
#: ``DECLARATIONS``), torch-free, whose ``algorithm`` module registers the function on first use; a module that
#: registers its losses when imported works too (it then imports torch at config time).
PLUGIN_GROUP = "recipe.losses"
# verl's loss aggregation modes (recipe.common implements them; listed here, torch-free, for config validation).
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
#: Config keys every loss call may read besides its declared parameters: no loss may declare a parameter so named.
CALL_KEYS = ("loss_agg_mode", "global_batch_info", "policy_loss", "rollout_is_weights", "config", "loss")


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    fn: PolicyLossFn
    batch_selector: Optional[BatchSelector] = None
    row_selector: Optional[RowSelector] = None
    declaration: Optional[LossDeclaration] = None


@dataclass
class RegistryState:
    """Everything the registry knows, in one place (a test snapshots and restores it whole).

    ``declared``: every loss's declaration by name (built-ins, plugins, losses registered at run time); ``owner``:
    who declared it (``built-in recipe.m2po``, ``plugin 'x' (mod)``, ``register_policy_loss``); ``algorithm``: the
    module that registers a declared loss's function, imported on first use; ``specs``: the registered functions;
    ``reserved``: parameter names owned by something else (a config's own fields) -> that owner; ``refused``: the
    one-line refusals so far (a plugin or a loss -> why); ``probed`` / ``flagged``: the losses the split probe ran
    on / flagged (:func:`split_flags`); ``builtins_loaded`` / ``plugins_loaded``: whether the
    built-in declarations / the entry points were read.
    """

    declared: dict[str, LossDeclaration] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)
    algorithm: dict[str, str] = field(default_factory=dict)
    specs: dict[str, PolicyLossSpec] = field(default_factory=dict)
    reserved: dict[str, str] = field(default_factory=lambda: {
        **{k: "every loss call" for k in CALL_KEYS},
        **{k: "the shared PPO-clip group (recipe.declaration.PPO_CLIP: opt in with LossDeclaration(ppo_clip=...))"
           for p in PPO_CLIP.params for k in {p.name, *p.names.values(), *PPO_CLIP.keys[p.name]}}})
    refused: dict[str, str] = field(default_factory=dict)
    builtins_loaded: bool = False
    plugins_loaded: bool = False
    probed: set = field(default_factory=set)
    flagged: dict[str, str] = field(default_factory=dict)


_STATE = RegistryState()


def snapshot() -> RegistryState:
    """A copy of the registry's whole state (declarations and functions are shared, the dicts copied)."""
    return copy.copy(RegistryState(**{k: copy.copy(v) for k, v in vars(_STATE).items()}))


def restore(state: RegistryState) -> None:
    """Put back a state taken with :func:`snapshot`."""
    for key, value in vars(state).items():
        setattr(_STATE, key, copy.copy(value))


def split_flags() -> dict[str, str]:
    """The losses the split probe flagged (registered and usable, but their gradient changed with the split)."""
    return dict(_STATE.flagged)


def registered_functions() -> dict[str, PolicyLossFn]:
    """{name: function} of the losses registered so far (no import: what an adapter compares a framework's registry
    with, to tell its own entries from ours)."""
    return {name: spec.fn for name, spec in _STATE.specs.items()}


def refusals() -> dict[str, str]:
    """The plugins and losses refused so far, each with its one-line reason and fix."""
    return dict(_STATE.refused)


def _refuse(key: str, message: str) -> None:
    if _STATE.refused.get(key) != message:
        _STATE.refused[key] = message
        logger.error("%s", message)


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ---------------------------------------------------------------------------------------------------- clashes


def _declaration_problem(decl: LossDeclaration, owner: str) -> Optional[str]:
    """Why ``decl`` (declared by ``owner``) cannot join the registry, or None: its name is another loss's, one of
    its parameter names is another loss's (declared differently) or a reserved one, or its name in some framework is
    another loss's there."""
    taken = _STATE.declared.get(decl.name)
    if taken is not None and taken != decl:
        return (f"loss {decl.name!r} is already declared by {_STATE.owner.get(decl.name, '?')}. Fix: give yours "
                f"another name (LossDeclaration(name=...))")
    for p in decl.params:
        if p.name in _STATE.reserved:
            return (f"parameter {p.name!r} of loss {decl.name!r} is a key of {_STATE.reserved[p.name]}. Fix: rename "
                    f"the parameter (e.g. {decl.name}_{p.name})")
        for other, odecl in _STATE.declared.items():
            if other == decl.name:
                continue
            for q in odecl.params:
                if q.name == p.name and q != p:
                    return (f"parameter {p.name!r} of loss {decl.name!r} is also a parameter of loss {other!r} "
                            f"({_STATE.owner.get(other, '?')}), declared differently. Fix: rename yours (e.g. "
                            f"{decl.name}_{p.name}), or reuse that loss's Param to share it")
    for framework, fname in decl.framework_names.items():
        for other, odecl in _STATE.declared.items():
            if other != decl.name and odecl.name_in(framework) == fname:
                return (f"loss {decl.name!r} has the {framework} name {fname!r}, which loss {other!r} already has "
                        f"there. Fix: LossDeclaration(framework_names={{{framework!r}: <another name>}})")
    for other, odecl in _STATE.declared.items():
        if other != decl.name:
            for framework, fname in odecl.framework_names.items():
                if fname == decl.name and decl.name_in(framework) == decl.name:
                    return (f"loss {decl.name!r} has the name loss {other!r} uses in {framework}. Fix: give yours "
                            f"another {framework} name: LossDeclaration(framework_names={{{framework!r}: ...}})")
    return None


def _declare(decl: LossDeclaration, owner: str, algorithm: str = "") -> None:
    """Add ``decl``; ValueError (one line) if it clashes."""
    problem = _declaration_problem(decl, owner)
    if problem is not None:
        raise ValueError(problem)
    _STATE.declared.setdefault(decl.name, decl)
    _STATE.owner.setdefault(decl.name, owner)
    if algorithm and decl.name not in _STATE.algorithm:
        _STATE.algorithm[decl.name] = algorithm


def reserve_param_names(names: Iterable[str], owner: str) -> dict[str, str]:
    """Make ``names`` (a config's own fields) unavailable as loss parameter names, owned by ``owner``. A declared
    plugin loss that already uses one is refused (alone, one line); a built-in that does is a bug here (TypeError).
    Returns the refusals this made."""
    _load_declarations()
    made = {}
    for name in names:
        _STATE.reserved.setdefault(name, owner)
    for lname, decl in list(_STATE.declared.items()):
        clash = next((p.name for p in decl.params if _STATE.reserved.get(p.name) == owner), None)
        if clash is None:
            continue
        msg = (f"policy loss {lname!r} ({_STATE.owner.get(lname)}) refused: its parameter {clash!r} is a key of "
               f"{owner}. Fix: rename the parameter (e.g. {lname}_{clash})")
        if _STATE.owner.get(lname, "").startswith("built-in"):
            raise TypeError(msg)
        _forget(lname)
        _refuse(lname, msg)
        made[lname] = msg
    return made


def _forget(name: str) -> None:
    for table in (_STATE.declared, _STATE.owner, _STATE.algorithm, _STATE.specs):
        table.pop(name, None)


def usable_declarations(framework: str, *, own_losses: Iterable[str] = (), own_fields: Iterable[str] = (),
                        field_name: Callable[[Any], str] = lambda p: p.name) -> dict[str, LossDeclaration]:
    """The one clash check of every adapter: {name: declaration} of the losses ``framework`` can take, i.e. every
    declared loss whose name there (``name_in(framework)``) is none of the framework's ``own_losses`` and none of
    whose parameters (named there by ``field_name``) is one of its ``own_fields``. Each loss left out is refused
    alone, with one logged line naming it, the clash and the fix (:func:`refusals`)."""
    own_losses, own_fields = set(own_losses), set(own_fields)
    out = {}
    for name, decl in declarations().items():
        fname = decl.name_in(framework)
        if fname in own_losses:
            _refuse(f"{framework}:{name}", f"policy loss {name!r} ({_STATE.owner.get(name, '?')}) is not offered in "
                    f"{framework}: {framework} has its own loss {fname!r}. Fix: give yours another {framework} name: "
                    f"LossDeclaration(framework_names={{{framework!r}: '<another name>'}})")
            continue
        clash = next((field_name(p) for p in decl.params if field_name(p) in own_fields), None)
        if clash is not None:
            _refuse(f"{framework}:{name}", f"policy loss {name!r} ({_STATE.owner.get(name, '?')}) is not offered in "
                    f"{framework}: its parameter {clash!r} is a config field of {framework}'s own. Fix: rename the "
                    f"parameter, or name it differently there: Param(..., names={{{framework!r}: '<another>'}})")
            continue
        out[name] = decl
    return out


# ---------------------------------------------------------------------------------------------------- registration


def register_policy_loss(name: Union[str, LossDeclaration], *, batch_selector: Optional[BatchSelector] = None,
                         row_selector: Optional[RowSelector] = None):
    """Decorator: register ``fn`` under ``name``, a loss name or its :class:`LossDeclaration`. Registering a
    different function under a taken name is an error (verl's registry silently overwrites, which hides plugin
    clashes), as is a declaration that clashes with another loss's (its name, a parameter name, a framework name).
    A declaration's ``step`` must match the selector given."""

    declaration = name if isinstance(name, LossDeclaration) else None
    name = declaration.name if declaration is not None else name
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")
    if batch_selector is not None and row_selector is not None:
        raise ValueError(f"policy loss {name!r}: give a batch_selector (one decision over the whole step) or a "
                         "row_selector (one per row), not both")
    step = "batch_selector" if batch_selector is not None else "row_selector" if row_selector is not None else "nothing"
    _load_builtin_declarations()
    if declaration is None:  # by name: the loss's declaration if it matches, else a bare one (no parameters)
        declared = _STATE.declared.get(name)
        declaration = declared if declared is not None and declared.step == step else \
            LossDeclaration(name=name, summary="(registered without a declaration)", step=step)
    if declaration.step != step:
        raise ValueError(f"policy loss {name!r}: its declaration says step={declaration.step!r} but it is registered "
                         f"with {step.replace('_', ' ') if step != 'nothing' else 'no selector'}; register the "
                         "selector its declaration names")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = _STATE.specs.get(name)
        if existing is not None and _qualname(existing.fn) != _qualname(fn):
            raise ValueError(
                f"policy loss {name!r} is already registered by {_qualname(existing.fn)}; "
                f"refusing to replace it with {_qualname(fn)}. Pick another name."
            )
        if existing is not None:  # the same function again (a module reload): it may bring a new declaration
            _STATE.declared[name] = declaration
        elif _STATE.declared.get(name) is not declaration:
            if name in _STATE.declared and _STATE.declared[name].summary == "(registered without a declaration)":
                _forget(name)  # a bare declaration made by an earlier registration by name gives way to a real one
            _declare(declaration, f"register_policy_loss ({_qualname(fn)})")
        _STATE.specs[name] = PolicyLossSpec(name=name, fn=fn, batch_selector=batch_selector,
                                            row_selector=row_selector, declaration=declaration)
        return fn

    return decorator


# ---------------------------------------------------------------------------------------------------- loading


def _module_declarations(module: Any) -> tuple[LossDeclaration, ...]:
    value = getattr(module, "DECLARATIONS", None)
    if value is None:
        value = (module.DECLARATION,) if getattr(module, "DECLARATION", None) is not None else ()
    return tuple(value)


def _load_builtin_declarations() -> None:
    """The built-ins' declarations (torch-free), once."""
    if _STATE.builtins_loaded:
        return
    _STATE.builtins_loaded = True
    for package, decl_module, algorithm in zip(_LOSS_PACKAGES, BUILTIN_DECLARATIONS, _BUILTIN_RECIPES):
        for decl in _module_declarations(importlib.import_module(decl_module)):
            if _STATE.declared.get(decl.name) is not decl:
                _declare(decl, f"built-in recipe.{package}", algorithm)


def load_plugins() -> list[str]:
    """Read the ``recipe.losses`` entry points once: each names a module (a declaration module, or one that
    registers its losses when imported). A plugin that fails to import or clashes is refused alone (one logged line,
    :func:`refusals`); the names of the plugins taken."""
    _load_builtin_declarations()
    if _STATE.plugins_loaded:
        return []
    _STATE.plugins_loaded = True
    from importlib.metadata import entry_points

    loaded = []
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        module_name = ep.value.split(":")[0]
        owner = f"plugin {ep.name!r} ({ep.value})"
        before = snapshot()
        try:
            module = importlib.import_module(module_name)
            for decl in _module_declarations(module):
                if _STATE.declared.get(decl.name) is decl:
                    continue  # it registered itself on import
                _declare(decl, owner, decl.algorithm or ("" if decl.name in _STATE.specs else module_name))
        except Exception as exc:  # noqa: BLE001 - refuse this plugin alone; the other losses must still work
            restore(before)
            _STATE.plugins_loaded = True
            what = str(exc) if isinstance(exc, ValueError) else f"it failed to import: {type(exc).__name__}: {exc}"
            fix = "" if "Fix:" in what else " Fix: fix the plugin or uninstall it."
            _refuse(ep.name, f"policy-loss plugin {ep.name!r} ({ep.value}, entry-point group {PLUGIN_GROUP!r}) "
                             f"refused: {what}.{fix}".replace("..", "."))
            continue
        for name in _STATE.specs:
            if name not in before.specs:
                _STATE.owner[name] = owner
        loaded.append(ep.name)
    return loaded


def _load_declarations() -> None:
    _load_builtin_declarations()
    load_plugins()


def _load_algorithm(name: str) -> None:
    """Import the module that registers loss ``name`` (first use). A plugin's that fails is refused alone."""
    if name in _STATE.specs or name not in _STATE.algorithm:
        return
    module = _STATE.algorithm[name]
    owner = _STATE.owner.get(name, "?")
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001
        if owner.startswith("built-in"):
            raise
        _forget(name)
        _refuse(name, f"policy loss {name!r} ({owner}) refused: its algorithm module {module!r} failed to import: "
                      f"{type(exc).__name__}: {exc}. Fix: fix the plugin or uninstall it.")
        return
    if name not in _STATE.specs:
        if owner.startswith("built-in"):
            raise ValueError(f"policy loss {name!r}: {module} did not register it (register_policy_loss(DECLARATION))")
        _forget(name)
        _refuse(name, f"policy loss {name!r} ({owner}) refused: importing {module!r} did not register it. Fix: "
                      "decorate its function with @register_policy_loss(DECLARATION) there, or set "
                      "LossDeclaration(algorithm='<the module that does>')")


def _load_all() -> None:
    _load_declarations()
    for name in list(_STATE.algorithm):
        _load_algorithm(name)


_load_builtins = _load_all  # the name older callers (and tests) use


def declarations(*, plugins: bool = True) -> dict[str, LossDeclaration]:
    """Every loss's declaration by name: the built-ins (torch-free), then (``plugins``) the entry-point losses and
    any registered at run time; refused ones left out."""
    _load_builtin_declarations()
    if plugins:
        load_plugins()
        return dict(_STATE.declared)
    return {n: d for n, d in _STATE.declared.items() if _STATE.owner.get(n, "").startswith("built-in")}


def declaration_owner(name: str) -> str:
    """Who declared loss ``name`` (``built-in recipe.m2po``, ``plugin 'x' (mod)``, ``register_policy_loss (...)``)."""
    _load_declarations()
    return _STATE.owner.get(name, "?")


def get_declaration(name: str) -> LossDeclaration:
    """The declaration of loss ``name``; a built-in's or a declaration-module plugin's answers without importing
    torch."""
    _load_declarations()
    found = _STATE.declared.get(name)
    if found is None:
        return get_policy_loss_spec(name).declaration  # raises, listing the registered losses
    return found


def _builtin_names() -> tuple[str, ...]:
    names = []
    for decl_module in BUILTIN_DECLARATIONS:
        names.extend(d.name for d in _module_declarations(importlib.import_module(decl_module)))
    return tuple(sorted(names))


# The built-in names, torch-free (a unit test keeps them in step with what the modules register).
BUILTIN_POLICY_LOSSES = _builtin_names()


def is_policy_loss_registered(name: str) -> bool:
    """Whether ``name`` is a declared (or registered) loss that was not refused; torch-free for a built-in and for a
    declaration-module plugin."""
    _load_declarations()
    return name in _STATE.declared


def registered_policy_losses() -> list[str]:
    """Names of all registered losses, sorted (every declared loss's algorithm imported: a plugin whose
    algorithm fails is refused then, alone)."""
    _load_all()
    return sorted(_STATE.specs)


def get_policy_loss_spec(name: str) -> PolicyLossSpec:
    _load_declarations()
    _load_algorithm(name)
    spec = _STATE.specs.get(name)
    if spec is None:
        _load_all()
        refused = _STATE.refused.get(name)
        if refused is not None:
            raise ValueError(refused)
        raise ValueError(
            f"unknown policy loss {name!r}; registered losses are: {', '.join(sorted(_STATE.specs))}. "
            "Set actor.loss (or policy_loss.loss_mode in verl) to one of these, or register yours with "
            "recipe.registry.register_policy_loss."
        )
    if name not in _STATE.probed:
        _probe_split(spec)
    return spec


def _probe_split(spec: PolicyLossSpec) -> None:
    """Once per loss of a ``recipe.losses`` plugin whose step needs nothing but its token count: does its step's
    loss or gradient change when the step is split (``recipe.split_probe`` on a small random batch)? A warning, one
    line, if it does (:func:`split_flags`); ``LossDeclaration(split_probe=False)`` opts out. A loss the probe cannot
    call is left alone. (A loss with a selector needs its planner: ``recipe.testing.assert_split_invariant``.)"""
    _STATE.probed.add(spec.name)
    decl = spec.declaration
    if decl is None or not decl.split_probe or decl.step != "nothing" or \
            not _STATE.owner.get(spec.name, "").startswith("plugin"):
        return
    try:
        from recipe.split_probe import is_split_invariant, split_gaps

        gaps = split_gaps(spec.fn)
    except Exception as exc:  # noqa: BLE001 - a probe, never a failure: the loss may need a config of its own
        logger.debug("split probe of policy loss %r skipped: %s: %s", spec.name, type(exc).__name__, exc)
        return
    if not is_split_invariant(gaps):
        _STATE.flagged[spec.name] = message = (f"policy loss {spec.name!r} ({_STATE.owner.get(spec.name, '?')}) is not "
                f"split-invariant on a probe batch: splitting a step into 2 or 4 micro-batches changes its loss by "
                f"{gaps[0]:.3g} and its gradient by {gaps[1]:.3g} (one call: {gaps[2]:.3g}, {gaps[3]:.3g}). Fix: "
                "aggregate with recipe.common.agg_loss(..., **global_batch_info(config)) and mask padding with "
                "torch.where (docs/adding-a-loss.md), or opt out: LossDeclaration(split_probe=False)")
        logger.warning("%s", message)


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
