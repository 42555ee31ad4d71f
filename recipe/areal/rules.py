"""Which AReaL actor settings the exact losses need, checked before any work, and the loss keys of AReaL's actor
config, generated from the loss declarations. Imports only ``recipe`` (torch-free: the declarations check the
loss parameters, ``Param.check`` and the declaration's cross-parameter rules).

The exact losses replace AReaL's ``grpo_loss_fn`` as a whole, so every AReaL key that only acts inside that function
would be silently ignored; those are refused here with the fix, as is the one combination in which AReaL overwrites
the behaviour log-probs that M2PO's ratio needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from recipe.declaration import PPO_CLIP, LossDeclaration, Param
from recipe.registry import get_declaration, is_policy_loss_registered, usable_declarations
from recipe.versions import check_framework_version

#: The framework name under which the loss declarations name and default AReaL's keys (``Param.name_in``).
FRAMEWORK = "areal"


def check_areal_version(version: Optional[str] = None) -> Optional[str]:
    """Refuse an AReaL outside the tested range (one line naming it and the override; ``recipe.versions``).

    Called when the adapter's config or actor is built: the exact path depends on AReaL's internals
    (``PPOActor._ppo_update`` calling ``engine.train_batch`` once per mini-batch)."""
    return check_framework_version("areal", version, where="recipe.areal")


#: Keys of AReaL's own ``PPOActorConfig`` (default None there) that a declared loss parameter shares: AReaL's field
#: is then the parameter's key (None = the loss's default). ``recipe.areal.config`` checks this list against AReaL.
AREAL_OWN_KEYS = ("m2_threshold",)
#: AReaL's own ``PPOActorConfig`` field names, set by :func:`loss_param_fields` from the config class it extends: a
#: loss parameter named like one (other than :data:`AREAL_OWN_KEYS`) is refused in AReaL alone.
_AREAL_FIELDS: set[str] = set()


def _declarations() -> dict[str, LossDeclaration]:
    """The losses AReaL can take (the clash check every adapter shares: AReaL has no loss names of its own, so only
    a parameter named like an AReaL actor field of another meaning is refused)."""
    return usable_declarations(FRAMEWORK, own_fields=_AREAL_FIELDS - set(AREAL_OWN_KEYS),
                               field_name=lambda p: p.name_in(FRAMEWORK))


def usable_losses() -> list[str]:
    """The names of the losses AReaL's actor config offers."""
    return sorted(_declarations())


def _declared_params() -> dict[str, tuple[Param, list[str]]]:
    """AReaL key -> (the parameter, the losses declaring it), over every declared loss (plugins included). Two losses
    may share a key only with one declaration of it (m2po and m2po_authors share tau)."""
    out: dict[str, tuple[Param, list[str]]] = {}
    for decl in _declarations().values():
        for p in decl.params:
            key = p.name_in(FRAMEWORK)
            if key in out and out[key][0] != p:
                raise TypeError(f"loss {decl.name!r} declares actor.{key} differently from loss {out[key][1][0]!r}; "
                                "a shared parameter needs one declaration (reuse the other loss's Param)")
            out.setdefault(key, (p, []))[1].append(decl.name)
    return out


def loss_param_fields(base: type) -> list[tuple[str, type, Any]]:
    """``dataclasses.make_dataclass`` fields for every declared loss parameter under its AReaL key, with its AReaL
    default and the declaration's help, choices and bounds as field metadata. A key that AReaL's ``base`` config
    already has (``m2_threshold``: AReaL's own M2PO) stays AReaL's field: it must default to None there (unset = the
    loss's default), else the declaration has to give the parameter another AReaL name (``Param.names``)."""
    own = {f.name: f for f in dataclasses.fields(base)}
    _AREAL_FIELDS.update(own)
    fields = []
    for key, (p, losses) in _declared_params().items():
        if key in AREAL_OWN_KEYS and key not in own:
            raise TypeError(f"actor.{key} is not a key of this AReaL's PPOActorConfig, but "
                            "recipe.areal.rules.AREAL_OWN_KEYS lists it; update that list")
        if key in own:
            if key not in AREAL_OWN_KEYS or own[key].default is not None:
                raise TypeError(f"loss {losses[0]!r}: its parameter {p.name!r} is AReaL's own actor.{key} (default "
                                f"{own[key].default!r}), which means something else there; give it another AReaL "
                                "name: Param(..., names={'areal': '<name>'})")
            continue
        kind = Optional[p.kind] if p.default_in(FRAMEWORK) is None else p.kind
        fields.append((key, kind, dataclasses.field(default=p.default_in(FRAMEWORK), metadata=p.metadata())))
    return fields


def _clip(actor: Any) -> tuple[float, float]:
    """AReaL's PPO clip (``eps_clip``, ``eps_clip_higher``), read by the shared group's reader."""
    clip = PPO_CLIP.read({"eps_clip": getattr(actor, "eps_clip", None),
                          "eps_clip_higher": getattr(actor, "eps_clip_higher", None)})
    return clip.low, clip.high


def loss_values(decl: LossDeclaration, actor: Any) -> dict[str, Any]:
    """The declared parameters of ``decl`` as set in an AReaL actor config (its AReaL keys; unset: the default)."""
    out = {}
    for p in decl.params:
        value = getattr(actor, p.name_in(FRAMEWORK), None)
        out[p.name] = p.default_in(FRAMEWORK) if value is None else value
    return out


def loss_config(actor: Any, loss: Optional[str] = None) -> dict[str, Any]:
    """The config the registered loss reads (``DECLARATION.read``): its parameters under their declared names from
    the AReaL keys, a step-scope parameter at its in-call value (the adapter plans the step: M2PO's selection runs
    before the micro-batches), and AReaL's PPO clip (``eps_clip``, ``eps_clip_higher``)."""
    decl = get_declaration(loss if loss is not None else actor.loss)
    out: dict[str, Any] = loss_values(decl, actor)
    if decl.step_scope is not None:
        out[decl.step_scope.param] = decl.step_scope.planned
    out.update(eps_clip=getattr(actor, "eps_clip", None), eps_clip_higher=getattr(actor, "eps_clip_higher", None))
    return out


def plan_scope(actor: Any, loss: Optional[str] = None) -> Optional[str]:
    """The value of the loss's step-scope parameter (M2PO's ``m2_scope``: ``dp_group`` plans over all
    data-parallel ranks, ``local`` over each rank's share), or None when it has none."""
    decl = get_declaration(loss if loss is not None else actor.loss)
    return None if decl.step_scope is None else loss_values(decl, actor)[decl.step_scope.param]


def plans_over_group(actor: Any, loss: Optional[str] = None) -> bool:
    """Whether the step's decision spans the data-parallel group: yes unless the loss's step-scope parameter is set
    to its declared local value (``StepScope.local``: M2PO's ``m2_scope: local``)."""
    decl = get_declaration(loss if loss is not None else actor.loss)
    return decl.step_scope is None or plan_scope(actor, loss) != decl.step_scope.local


def exact_loss_config_errors(actor: Any, where: str = "actor.") -> list[str]:
    """One line per problem with an AReaL actor config (any object with its attributes) under the exact losses.

    Empty when ``actor.loss`` is unset (AReaL's own loss, untouched) or when everything fits. The loss's parameters
    are checked by their declaration (``Param.check`` and its cross-parameter rules).
    """
    loss = getattr(actor, "loss", None)
    if loss is None:
        return []
    if not isinstance(loss, str) or not is_policy_loss_registered(loss):
        return [f"{where}loss must be one of {', '.join(sorted(_declarations()))} (or a name registered with "
                f"recipe.registry.register_policy_loss), got {loss!r}; or leave it unset for AReaL's own loss"]
    errors = []
    decoupled = bool(getattr(actor, "use_decoupled_loss", False))
    if not decoupled and bool(getattr(actor, "recompute_logprob", False)):
        errors.append(
            f"{where}loss={loss} needs the behaviour (rollout) log-probs in AReaL's `logprobs`, but "
            f"{where}recompute_logprob=true with {where}use_decoupled_loss=false makes AReaL overwrite them with the "
            f"recomputed ones; set {where}use_decoupled_loss=true (or {where}recompute_logprob=false)")
    if getattr(actor, "use_sapo_loss", False):
        errors.append(f"{where}use_sapo_loss=true selects AReaL's SAPO loss, which {where}loss={loss} replaces; "
                      f"set {where}use_sapo_loss=false")
    level = getattr(actor, "importance_sampling_level", "token")
    if level != "token":
        errors.append(f"{where}importance_sampling_level={level!r} (GSPO) is not part of {where}loss={loss}, whose "
                      f"ratios are per token; set {where}importance_sampling_level=token")
    if getattr(actor, "enable_tree_training", False):
        errors.append(f"{where}enable_tree_training=true packs sequences as prefix trees, which {where}loss={loss} "
                      f"cannot lay out as rows (it needs each sequence's own tokens and cu_seqlens); set "
                      f"{where}enable_tree_training=false")
    if getattr(actor, "rejection_sampling", None) is not None:
        errors.append(f"{where}rejection_sampling acts inside AReaL's own loss and {where}loss={loss} would ignore "
                      f"it; set {where}rejection_sampling=null")
    decl = get_declaration(loss)
    if "c_clip" not in decl.ppo_clip and getattr(actor, "c_clip", None) is not None:  # its declaration says
        errors.append(f"{where}c_clip is a PPO dual clip that {where}loss={loss} does not read (its PPO-clip keys: "
                      f"{', '.join(decl.ppo_clip) or 'none'}; its own: "
                      f"{', '.join(p.name_in(FRAMEWORK) for p in decl.params) or 'none'}); set {where}c_clip=null")
    mine = {p.name_in(FRAMEWORK) for p in decl.params}
    for key in AREAL_OWN_KEYS:  # AReaL's own key, set, that another loss's parameter shares: it would do nothing
        losses = _declared_params().get(key, (None, []))[1]
        if key not in mine and losses and getattr(actor, key, None) is not None:
            errors.append(f"{where}{key} is a parameter of {' and '.join(losses)} (and AReaL's own key) and "
                          f"{where}loss={loss} would ignore it; set {where}{key}=null (or {where}loss={losses[0]})")
    values, bad = {}, False
    for p in decl.params:
        key = p.name_in(FRAMEWORK)
        value = getattr(actor, key, None)
        try:
            values[p.name] = p.default_in(FRAMEWORK) if value is None else p.check(value, f"{where}{key}")
        except ValueError as err:
            errors.append(str(err))
            bad = True
    if not bad:
        errors.extend(f"{where}{decl.param(name).name_in(FRAMEWORK)} {msg}"
                      for name, msg in decl.problems(values, _clip(actor)))
    return errors


def check_exact_loss_config(actor: Any, where: str = "actor.") -> None:
    """Raise ``ValueError`` with every problem found by :func:`exact_loss_config_errors`, one per line."""
    errors = exact_loss_config_errors(actor, where)
    if errors:
        raise ValueError("; ".join(errors) if len(errors) == 1 else "\n".join(errors))
