"""What the TRL adapter needs without importing TRL: loss names, the TRL check, and GRPOConfig's rules.

Kept free of ``trl`` (torch only where the losses' own rules are checked) so the rules can be unit-tested and the import
error stays one clear line.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Optional

#: TRL 1.16's own ``loss_type`` values, pinned (TRL has no public registry of them; a test in the TRL lane checks
#: this list against the values ``trl.GRPOConfig``'s ``loss_type`` help documents). A registered loss whose TRL name
#: is one of them is refused in TRL alone (``recipe.registry.usable_declarations``).
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo", "vespo")
FRAMEWORK = "trl"
INSTALL_HINT = 'pip install -e ".[trl]" from a stalerl checkout (trl>=1.16,<1.17)'
#: TRL's defaults of its vLLM importance-sampling settings (a test checks them against trl.GRPOConfig).
TRL_VLLM_IS_DEFAULTS = {"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
                        "vllm_importance_sampling_clip_min": None}


#: ``trl.GRPOConfig``'s own field names, set by :mod:`recipe.trl.config` when it imports TRL: a loss parameter named
#: like one (``beta``, ``epsilon``, ...) would take TRL's field, so such a loss is refused in TRL.
TRL_OWN_FIELDS: tuple[str, ...] = ()


def declarations() -> dict[str, Any]:
    """{TRL ``loss_type``: declaration} of every registered loss TRL can take (built-ins and ``recipe.losses``
    plugins): one whose TRL name is TRL's own loss type, or with a parameter named like a GRPOConfig field of TRL's,
    is refused alone with one logged line (the clash check every adapter shares)."""
    from recipe.registry import usable_declarations

    usable = usable_declarations(FRAMEWORK, own_losses=TRL_LOSS_TYPES, own_fields=TRL_OWN_FIELDS,
                                 field_name=lambda p: p.name_in(FRAMEWORK))
    return {decl.name_in(FRAMEWORK): decl for decl in usable.values()}


def stalerl_loss_types() -> tuple[str, ...]:
    """The ``loss_type`` values this adapter adds to TRL's GRPOTrainer: every loss of ``recipe.registry``."""
    return tuple(sorted(declarations()))


def config_params() -> dict[str, Any]:
    """{GRPOConfig field: Param}: every registered loss's parameters under their TRL names (one field per name; a
    step-scope parameter is the adapter's business: it always plans the whole step over every process)."""
    out: dict[str, Any] = {}
    for decl in declarations().values():
        for p in decl.params:
            if decl.is_step_scope(p):
                continue
            key = p.name_in(FRAMEWORK)
            seen = out.get(key)
            if seen is not None and (seen.default_in(FRAMEWORK), seen.kind) != (p.default_in(FRAMEWORK), p.kind):
                raise ValueError(f"recipe.trl: losses declare the parameter {key!r} twice with different defaults or "
                                 f"types ({seen.default_in(FRAMEWORK)!r} vs {p.default_in(FRAMEWORK)!r}); rename one")
            out.setdefault(key, p)
    return out


def __getattr__(name: str) -> Any:
    if name == "STALERL_LOSS_TYPES":
        return stalerl_loss_types()
    raise AttributeError(f"module 'recipe.trl.losses' has no attribute {name!r}")


def require_trl() -> None:
    """Raise ImportError naming the extra when TRL is not importable."""
    if importlib.util.find_spec("trl") is None:
        raise ImportError(f"recipe.trl needs TRL, which is not installed; install it with: {INSTALL_HINT}")


def check_vllm_logprobs_mode(mode: Any, loss_type: str) -> None:
    """The sampler's log-probs are the behaviour policy of m2po/fipo: they must be after temperature / top-p."""
    if mode != "processed_logprobs":
        raise ValueError(f"recipe.trl: loss_type={loss_type!r} takes vLLM's sampling log-probs as the behaviour "
                         f"policy, but the vLLM server runs with --logprobs-mode {mode}, whose log-probs are before "
                         "temperature scaling and logit processing, so every ratio would be biased. Fix: restart the "
                         "server with `trl vllm-serve` or `vllm serve ... --logprobs-mode processed_logprobs`")


def _clip(args: Any) -> tuple[float, float]:
    """TRL's PPO clip, read by the shared group's reader under TRL's names (``epsilon``, ``epsilon_high``)."""
    from recipe.declaration import PPO_CLIP

    try:
        clip = PPO_CLIP.read({p.name: getattr(args, p.name_in(FRAMEWORK), None) for p in PPO_CLIP.params
                              if p.name != "c_clip"})
    except ValueError as err:  # name TRL's fields, not the group's
        raise ValueError(str(err).replace("eps_clip_higher", "GRPOConfig.epsilon_high")
                         .replace("eps_clip", "GRPOConfig.epsilon")) from None
    return clip.low, clip.high


def loss_config(args: Any) -> dict[str, Any]:
    """The registry config of ``args.loss_type`` for a GRPOConfig: the loss's parameters (from their generated
    fields) and the PPO clip from TRL's ``epsilon`` / ``epsilon_high``."""
    decl = declarations()[args.loss_type]
    low, high = _clip(args)
    config = {p.name: getattr(args, p.name_in(FRAMEWORK)) for p in decl.params if not decl.is_step_scope(p)}
    config.update(clip_ratio_low=low, clip_ratio_high=high)
    return config


#: TRL's vLLM importance-sampling modes that ``recipe.rollout_correction`` reproduces exactly (TRL 1.16's
#: ``_generate_and_score_completions``; rho = exp(old_per_token_logps - sampling_per_token_logps), a NaN sampling
#: log-prob giving rho = 1): ``token_truncate`` w = min(rho, clip_max) = ``tis_token``; ``sequence_truncate``
#: w = min(exp(sum log rho), clip_max) on the row = ``tis_seq``; ``token_mask`` w = rho inside [clip_min, clip_max],
#: else 0 (the token stays in the denominator) = ``icepop``'s weights with the loss mask unchanged. Not mapped:
#: ``sequence_mask`` (the row's ratio as its weight, zero outside the bounds: no rollout_correction mode weights a
#: row by its ratio) and a ``clip_min`` above 0 with the truncating modes (a lower clamp).
TRL_IS_MODES = {"token_truncate": "tis_token", "sequence_truncate": "tis_seq", "token_mask": "icepop"}


def vllm_correction(args: Any) -> Optional[dict[str, Any]]:
    """``recipe.rollout_correction.correction_weights`` keywords (mode, threshold, low, high) equal to TRL's vLLM
    importance-sampling correction of ``args``, or None when it is off; ValueError (one line naming the fields) for
    a setting with no exact counterpart."""
    if not (getattr(args, "use_vllm", False) and bool(args.vllm_importance_sampling_correction)):
        return None
    mode = args.vllm_importance_sampling_mode
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    why = None
    if mode not in TRL_IS_MODES:
        why = (f"vllm_importance_sampling_mode={mode!r} has no exact counterpart in recipe.rollout_correction "
               "(TRL weights a kept row by its sequence ratio)")
    elif high is None or not math.isfinite(float(high)) or float(high) <= 0:
        why = f"vllm_importance_sampling_clip_max={high!r} must be a finite number > 0 for the loss's correction"
    elif mode != "token_mask" and low is not None and float(low) > 0:
        why = (f"vllm_importance_sampling_clip_min={low!r} (a lower clamp of the weight) has no exact counterpart in "
               "recipe.rollout_correction's truncated modes")
    elif mode == "token_mask" and low is not None and not 0 <= float(low) < float(high):
        why = f"vllm_importance_sampling_clip_min={low!r} must be >= 0 and below vllm_importance_sampling_clip_max"
    if why is not None:
        raise ValueError(f"GRPOConfig.vllm_importance_sampling_correction=True is not supported with "
                         f"loss_type={args.loss_type!r} as set: GRPOConfig.{why}. Fix: set "
                         f"vllm_importance_sampling_mode to one of {', '.join(TRL_IS_MODES)} with a finite "
                         "vllm_importance_sampling_clip_max, or vllm_importance_sampling_correction=False")
    out = {"mode": TRL_IS_MODES[mode], "threshold": float(high)}
    if mode == "token_mask":
        out.update(low=float(low or 0.0), high=float(high))
    return out


def validate_grpo_args(args: Any) -> None:
    """GRPOConfig's extra rules, one ValueError line naming the field, before any model is built.

    For this project's losses: the loss's own keys (``Param.check`` and the declaration's rules), and the TRL options
    that would change the objective the loss defines (or would make the optimizer step's micro-batches unknown at
    its first one) are refused.
    """
    loss = args.loss_type
    ours = declarations()
    if loss not in ours and loss not in TRL_LOSS_TYPES:
        raise ValueError(f"GRPOConfig.loss_type={loss!r} is unknown; choose one of "
                         f"{', '.join(sorted(ours) + list(TRL_LOSS_TYPES))} ({', '.join(sorted(ours))} from "
                         "recipe.registry, the rest TRL's)")
    if loss not in ours:
        return
    decl = ours[loss]
    values = {p.name: p.check(getattr(args, p.name_in(FRAMEWORK)), f"GRPOConfig.{p.name_in(FRAMEWORK)}",
                               framework=FRAMEWORK)
              for p in decl.params if not decl.is_step_scope(p)}
    try:
        decl.raise_problems(values, _clip(args), where="GRPOConfig.")
    except ValueError as err:
        raise ValueError(str(err).replace("eps_high", "epsilon_high").replace("eps_low", "epsilon")) from None
    refused = (
        ("importance_sampling_level", args.importance_sampling_level != "token", "'token'",
         "the loss defines its own per-token objective"),
        ("delta", args.delta is not None, "None", "TRL's two-sided clip is not part of the loss's objective"),
        ("off_policy_mask_threshold", args.off_policy_mask_threshold is not None, "None",
         "the loss decides itself which tokens of stale data count"),
        ("top_entropy_quantile", args.top_entropy_quantile < 1.0, "1.0", "an entropy mask changes the token set"),
        ("entropy_coef", args.entropy_coef != 0.0 or args.use_adaptive_entropy, "0.0 (and use_adaptive_entropy=False)",
         "the losses have no entropy bonus"),
    )
    if getattr(args, "use_vllm", False):
        if bool(args.vllm_importance_sampling_correction):
            vllm_correction(args)  # raises for a setting rollout_correction does not reproduce exactly
        else:
            for key, default in TRL_VLLM_IS_DEFAULTS.items():
                refused += ((key, getattr(args, key, default) != default, repr(default),
                             "it only configures TRL's importance-sampling correction, which is off"),)
    for field, bad, want, why in refused:
        if bad:
            raise ValueError(f"GRPOConfig.{field}={getattr(args, field)!r} is not supported with loss_type={loss!r} "
                             f"({why}); set {field}={want}")
    spg, ga = args.steps_per_generation, args.gradient_accumulation_steps
    if spg % ga != 0:
        raise ValueError(f"GRPOConfig.steps_per_generation={spg} must be a multiple of "
                         f"gradient_accumulation_steps={ga} with loss_type={loss!r}: otherwise an optimizer step "
                         f"spans two generation batches and its micro-batches are not all known at its first one; "
                         f"set steps_per_generation={ga}")
