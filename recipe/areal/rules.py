"""Which AReaL actor settings the exact losses need, checked before any work. Imports only ``recipe`` (FIPO's key
check and M2PO's threshold check, the recipe's own, import torch lazily).

The exact losses replace AReaL's ``grpo_loss_fn`` as a whole, so every AReaL key that only acts inside that function
would be silently ignored; those are refused here with the fix, as is the one combination in which AReaL overwrites
the behaviour log-probs that M2PO's ratio needs.
"""

from __future__ import annotations

from typing import Any, Optional

from recipe.registry import BUILTIN_POLICY_LOSSES, is_policy_loss_registered
from recipe.versions import check_framework_version

#: Algorithm 1's tau when ``actor.m2_threshold`` is left unset under ``actor.loss=m2po``.
DEFAULT_M2_THRESHOLD = 0.04


def check_areal_version(version: Optional[str] = None) -> Optional[str]:
    """Refuse an AReaL outside the tested range (one line naming it and the override; ``recipe.versions``).

    Called when the adapter's config or actor is built: the exact path depends on AReaL's internals
    (``PPOActor._ppo_update`` calling ``engine.train_batch`` once per mini-batch)."""
    return check_framework_version("areal", version, where="recipe.areal")
#: The losses whose objective has no PPO dual clip, so AReaL's ``c_clip`` would be ignored.
_NO_DUAL_CLIP = ("m2po", "no_trust_region", "fipo")


def exact_loss_config_errors(actor: Any, where: str = "actor.") -> list[str]:
    """One line per problem with an AReaL actor config (any object with its attributes) under the exact losses.

    Empty when ``actor.loss`` is unset (AReaL's own loss, untouched) or when everything fits.
    """
    loss = getattr(actor, "loss", None)
    if loss is None:
        return []
    if not isinstance(loss, str) or not is_policy_loss_registered(loss):
        return [f"{where}loss must be one of {', '.join(BUILTIN_POLICY_LOSSES)} (or a name registered with "
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
    if loss in _NO_DUAL_CLIP and getattr(actor, "c_clip", None) is not None:
        errors.append(f"{where}c_clip is a PPO dual clip that {where}loss={loss} does not have"
                      + (f" (FIPO's is {where}fipo_clip_ratio_c)" if loss == "fipo" else "")
                      + f"; set {where}c_clip=null")
    threshold = getattr(actor, "m2_threshold", None)
    if loss != "m2po" and threshold is not None:
        errors.append(f"{where}m2_threshold is M2PO's threshold and {where}loss={loss} would ignore it; set "
                      f"{where}m2_threshold=null (or {where}loss=m2po)")
    if loss == "m2po" and threshold is not None:
        from recipe.m2po.algorithm import m2_threshold_from_config  # the recipe's own check (imports torch)

        try:
            m2_threshold_from_config({"m2_threshold": threshold})
        except ValueError as err:
            errors.append(f"{where}{err} (M2PO's tau); e.g. {where}m2_threshold={DEFAULT_M2_THRESHOLD}")
    if loss == "fipo":
        from recipe.fipo.algorithm import fipo_params_from_config

        try:
            fipo_params_from_config(actor)
        except ValueError as err:
            errors.append(f"{where}{err}")
    return errors


def check_exact_loss_config(actor: Any, where: str = "actor.") -> None:
    """Raise ``ValueError`` with every problem found by :func:`exact_loss_config_errors`, one per line."""
    errors = exact_loss_config_errors(actor, where)
    if errors:
        raise ValueError("; ".join(errors) if len(errors) == 1 else "\n".join(errors))
