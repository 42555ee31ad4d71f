"""verl ``PolicyLossConfig`` subclasses for every registered loss, generated from the losses' declarations.

Select one in a verl config with::

    actor_rollout_ref.actor.policy_loss._target_=recipe.verl.config.M2POPolicyLossConfig

(the packaged ``m2po_trainer.yaml`` does; ``fipo_trainer.yaml`` selects ``FIPOPolicyLossConfig``). verl instantiates
it with Hydra wherever it builds the actor config: in the driver (``validate_config``) and in each actor worker
(``init_model``). Importing this module registers the stalerl losses in verl's registry (a backstop for the
``verl.plugins`` entry point), and fails loudly if that is impossible.

One class per loss in ``recipe.registry.declarations()`` -- the built-ins and every plugin loss (entry-point group
``recipe.losses``) -- so a plugin loss runs in verl without editing a file here:

- its name: ``M2POPolicyLossConfig`` (``m2po``) and ``FIPOPolicyLossConfig`` (``fipo``), else the loss's verl name in
  CamelCase + ``PolicyLossConfig`` (``StalerlVanillaPolicyLossConfig``, ``NoTrustRegionPolicyLossConfig``,
  ``M2poAuthorsPolicyLossConfig``, a plugin ``throwaway``: ``ThrowawayPolicyLossConfig``); all are attributes of this
  module, so ``_target_: recipe.verl.config.<name>`` works (:func:`policy_loss_config_class`,
  :func:`policy_loss_config_target`);
- ``loss_mode``: the loss's verl name (``declaration.name_in("verl")``) by default;
- one field per loss parameter (under ``actor_rollout_ref.actor.policy_loss``): its verl name
  (``Param.name_in("verl")``), its verl default (``Param.default_in("verl")``: ``m2_scope`` is ``local`` in verl), its
  help and bounds as field metadata; checked at config time by ``Param.check`` (the one validation; the message names
  ``actor_rollout_ref.actor.policy_loss.<key>``) and by the declaration's cross-parameter rules. The PPO clip is the
  actor's (``clip_ratio_low`` / ``clip_ratio_high``, outside ``policy_loss``): at config time the rules run with the
  clip at 0, and the loss runs them again with the actor's clip on its first call (FIPO's ``fipo_clip_ratio_c >
  1 + clip_ratio_high``: a ValueError naming both keys);
- verl-adapter keys that are no loss parameter: FIPO's ``fipo_allow_split_step`` (bool, default false; accept verl's
  split optimizer step as an approximation, recipe/verl/losses.py).

The parameters and their meaning: recipe/<loss>/declaration.py (``m2_threshold``, ``m2_scope``; the ``fipo_*`` keys).
"""

from __future__ import annotations

from dataclasses import field, make_dataclass, replace
from typing import Any

from verl.workers.config import PolicyLossConfig

from recipe.declaration import LossDeclaration, Param
from recipe.registry import declarations, refusals
from recipe.verl import verl_loss_names
from recipe.verl.losses import allow_split_param, needs_whole_step
from recipe.verl.plugin import register as _register

# Backstop registration: runs in every process that instantiates this config, even with
# VERL_USE_EXTERNAL_PLUGINS=none or a broken entry point; raises (so Hydra fails loudly) if it cannot register.
_register()

KEY_PREFIX = "actor_rollout_ref.actor.policy_loss"
#: Class names kept from before the classes were generated (the packaged configs' ``_target_``).
CLASS_NAMES = {"m2po": "M2POPolicyLossConfig", "fipo": "FIPOPolicyLossConfig"}
def adapter_params(declaration: LossDeclaration) -> tuple[Param, ...]:
    """Keys of the verl adapter, not of the loss: the split-step opt-in of a loss verl runs behind the whole-step
    check (its declaration's ``step``; FIPO's ``fipo_allow_split_step``)."""
    return (allow_split_param(declaration.name),) if needs_whole_step(declaration) else ()
#: The PPO clip the cross-parameter rules see at config time (the actor's clip is outside ``policy_loss``).
CONFIG_TIME_CLIP = (0.0, 0.0)

_CLASSES: dict[str, type] = {}


def _class_name(declaration: LossDeclaration) -> str:
    verl_name = declaration.name_in("verl")
    return CLASS_NAMES.get(declaration.name) or \
        "".join(part.capitalize() for part in verl_name.replace("-", "_").split("_")) + "PolicyLossConfig"


def _declarations() -> dict[str, LossDeclaration]:
    """The losses verl takes (recipe.verl.verl_loss_names: a loss refused there has no config class)."""
    found = declarations()
    return {name: found[name] for name in verl_loss_names().values()}


def _declaration(name: str) -> LossDeclaration:
    found = _declarations()
    by_verl_name = {d.name_in("verl"): d for d in found.values()}
    if name in found:
        return found[name]
    if name in by_verl_name:
        return by_verl_name[name]
    refused = refusals().get(f"verl:{name}") or refusals().get(name)
    if refused is not None:
        raise ValueError(refused)
    raise ValueError(f"unknown policy loss {name!r}; the registered losses (verl names) are: "
                     f"{', '.join(sorted(by_verl_name))}")


def _check(self: Any) -> None:
    """``__post_init__`` of every generated class: verl's, then each key by ``Param.check``, then the rules."""
    parent = getattr(PolicyLossConfig, "__post_init__", None)  # verl's own checks, where it has any
    if parent is not None:
        parent(self)
    declaration = _declaration(self._stalerl_loss)
    values = {}
    for p in (*declaration.params, *adapter_params(declaration)):
        key = p.name_in("verl")
        # checked as verl's key, so that its "Fix:" names verl's default (m2_scope: local)
        value = p.check(getattr(self, key), f"{KEY_PREFIX}.{key}", framework="verl")
        object.__setattr__(self, key, value)  # BaseConfig freezes fields after __init__; normalise in place
        values[p.name] = value
    problems = declaration.problems({p.name: values[p.name] for p in declaration.params}, CONFIG_TIME_CLIP)
    if problems:
        raise ValueError("; ".join(f"{KEY_PREFIX}.{declaration.param(key).name_in('verl')} {message}"
                                   for key, message in problems))
    if not isinstance(self.loss_mode, str) or not self.loss_mode:
        raise ValueError(f"{KEY_PREFIX}.loss_mode must be a non-empty string, got {self.loss_mode!r}")


def _make_class(declaration: LossDeclaration) -> type:
    name = _class_name(declaration)
    fields: list[tuple[str, type, Any]] = [("loss_mode", str, field(default=declaration.name_in("verl")))]
    namespace: dict[str, Any] = {"_stalerl_loss": declaration.name, "__post_init__": _check}
    for p in declaration.params:
        key = p.name_in("verl")
        fields.append((key, p.kind, field(default=p.default_in("verl"), metadata=p.metadata())))
        if key != p.name:  # the loss reads its own name (LossDeclaration.read): alias it to the verl field
            namespace[p.name] = property(lambda self, _key=key: getattr(self, _key))
    for p in adapter_params(declaration):
        fields.append((p.name, p.kind, field(default=p.default, metadata=p.metadata())))
    keys = ", ".join(f"``{f[0]}``" for f in fields[1:]) or "none of its own"
    cls = make_dataclass(name, fields, bases=(PolicyLossConfig,), namespace=namespace)
    cls.__module__ = __name__
    cls.__doc__ = (f"verl ``PolicyLossConfig`` for the loss ``{declaration.name_in('verl')}`` "
                   f"(recipe.registry ``{declaration.name}``: {declaration.summary}); keys: {keys}. Generated from its "
                   "declaration (module docstring).")
    return cls


def policy_loss_config_class(name: str) -> type:
    """The ``PolicyLossConfig`` subclass of loss ``name`` (its registry name or its verl name), made once."""
    declaration = _declaration(name)
    cls = _CLASSES.get(declaration.name)
    if cls is None:
        cls = _CLASSES[declaration.name] = _make_class(declaration)
        globals()[cls.__name__] = cls  # importable as recipe.verl.config.<name> (Hydra's _target_, pickle)
    return cls


def policy_loss_config_target(name: str) -> str:
    """``policy_loss._target_`` for loss ``name``: ``recipe.verl.config.<class name>``."""
    return f"{__name__}.{policy_loss_config_class(name).__name__}"


for _name in _declarations():
    policy_loss_config_class(_name)

for _name, _cls_name in CLASS_NAMES.items():  # M2POPolicyLossConfig, FIPOPolicyLossConfig (unless refused in verl)
    if _name in _CLASSES:
        globals()[_cls_name] = _CLASSES[_name]


def __getattr__(name: str) -> type:
    """A loss registered after this module was imported: its class on first access (``_target_`` included); the
    class of a loss refused in verl raises its one-line refusal."""
    if name.endswith("PolicyLossConfig"):
        for declaration in _declarations().values():
            if _class_name(declaration) == name:
                return policy_loss_config_class(declaration.name)
        for declaration in declarations().values():
            if _class_name(declaration) == name:
                why = refusals().get(f"verl:{declaration.name}") or refusals().get(declaration.name)
                raise AttributeError(f"{__name__}.{name}: {why}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FIPOPolicyLossConfig", "M2POPolicyLossConfig", "policy_loss_config_class", "policy_loss_config_target"]
