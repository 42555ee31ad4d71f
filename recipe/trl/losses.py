"""What the TRL adapter needs without importing TRL: loss names, the TRL check, and GRPOConfig's rules.

Kept free of ``trl`` (torch only where FIPO's rules are checked) so the rules can be unit-tested and the import
error stays one clear line.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

#: The losses this adapter adds to TRL's GRPOTrainer (the names of ``recipe.registry``).
STALERL_LOSS_TYPES = ("m2po", "fipo")
#: TRL 1.16's own ``loss_type`` values (its ``_compute_loss`` if/elif chain; a test keeps this in step with it).
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo", "vespo")
#: The TRL versions this adapter was written and tested against: [low, high).
SUPPORTED_TRL = ("1.16", "1.17")
INSTALL_HINT = 'pip install "stalerl[trl]" (trl>=1.16,<1.17)'


def require_trl() -> None:
    """Raise ImportError naming the extra when TRL is not importable."""
    if importlib.util.find_spec("trl") is None:
        raise ImportError(f"recipe.trl needs TRL, which is not installed; install it with: {INSTALL_HINT}")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def trl_version_supported(version: str) -> bool:
    low, high = (_version_tuple(v) for v in SUPPORTED_TRL)
    return low <= _version_tuple(version)[:2] < high


def loss_config(args: Any) -> dict[str, Any]:
    """The registry config (``recipe.registry`` keys) for a GRPOConfig: threshold, FIPO keys, PPO clip from TRL's
    ``epsilon`` / ``epsilon_high``."""
    low = float(args.epsilon)
    high = float(args.epsilon_high) if getattr(args, "epsilon_high", None) is not None else low
    return {
        "m2_threshold": args.m2_threshold,
        "fipo_decay_rate": args.fipo_decay_rate,
        "fipo_clip_ratio_c": args.fipo_clip_ratio_c,
        "fipo_influence_clip_ratio": args.fipo_influence_clip_ratio,
        "fipo_influence_clip_high_only": args.fipo_influence_clip_high_only,
        "fipo_safety_threshold": args.fipo_safety_threshold,
        "clip_ratio_low": low,
        "clip_ratio_high": high,
    }


def validate_grpo_args(args: Any) -> None:
    """GRPOConfig's extra rules, one ValueError line naming the field, before any model is built.

    For ``m2po`` / ``fipo``: the loss's own keys, and the TRL options that would change the objective those losses
    define (or would make the optimizer step's micro-batches unknown at its first one) are refused.
    """
    loss = args.loss_type
    if loss not in STALERL_LOSS_TYPES + TRL_LOSS_TYPES:
        raise ValueError(f"GRPOConfig.loss_type={loss!r} is unknown; choose one of "
                         f"{', '.join(STALERL_LOSS_TYPES + TRL_LOSS_TYPES)} (m2po/fipo from stalerl, the rest TRL's)")
    if loss not in STALERL_LOSS_TYPES:
        return
    tau = args.m2_threshold
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"GRPOConfig.m2_threshold must be a finite number >= 0 (M2PO's tau), got {tau!r}; "
                         "the paper's default is 0.04")
    if loss == "fipo":
        from recipe.fipo.algorithm import fipo_params_from_config  # torch-only module, imported when needed

        try:
            fipo_params_from_config(loss_config(args))
        except ValueError as err:
            raise ValueError(f"GRPOConfig.{err}") from None
    refused = (
        ("importance_sampling_level", args.importance_sampling_level != "token", "'token'",
         "the loss defines its own per-token objective"),
        ("delta", args.delta is not None, "None", "FIPO has its own dual clip; M2PO has no clip"),
        ("off_policy_mask_threshold", args.off_policy_mask_threshold is not None, "None",
         "M2PO's selection / FIPO's sequence drop replace the off-policy sequence mask"),
        ("top_entropy_quantile", args.top_entropy_quantile < 1.0, "1.0", "an entropy mask changes the token set"),
        ("entropy_coef", args.entropy_coef != 0.0 or args.use_adaptive_entropy, "0.0 (and use_adaptive_entropy=False)",
         "the losses have no entropy bonus"),
    )
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
