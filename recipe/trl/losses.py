"""What the TRL adapter needs without importing TRL: loss names, the TRL check, and GRPOConfig's rules.

Kept free of ``trl`` (torch only where the losses' own rules are checked) so the rules can be unit-tested and the import
error stays one clear line.
"""

from __future__ import annotations

import importlib.util
from typing import Any

#: The losses this adapter adds to TRL's GRPOTrainer (the names of ``recipe.registry``).
STALERL_LOSS_TYPES = ("m2po", "fipo")
#: TRL 1.16's own ``loss_type`` values (its ``_compute_loss`` if/elif chain). At run time the adapter reads TRL's
#: list from the installed TRL's source (:func:`trl_loss_types_from_source`) and refuses to start if it contains one of
#: ``STALERL_LOSS_TYPES``; a test keeps this copy equal to what the installed TRL has.
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo", "vespo")
INSTALL_HINT = 'pip install -e ".[trl]" from a stalerl checkout (trl>=1.16,<1.17)'
#: TRL's defaults of its vLLM importance-sampling settings (a test checks them against trl.GRPOConfig).
TRL_VLLM_IS_DEFAULTS = {"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
                        "vllm_importance_sampling_clip_min": None}


def require_trl() -> None:
    """Raise ImportError naming the extra when TRL is not importable."""
    if importlib.util.find_spec("trl") is None:
        raise ImportError(f"recipe.trl needs TRL, which is not installed; install it with: {INSTALL_HINT}")


def trl_loss_types_from_source(*sources: str) -> tuple[str, ...]:
    """The ``loss_type`` names that TRL's source compares a ``.loss_type`` with (``==`` or ``in``), in order.

    Given the source of ``trl.trainer.grpo_trainer`` (and ``grpo_config``), this is the set of loss types TRL
    implements: its ``_compute_loss`` branches and its ``__init__`` rules all read ``self.loss_type`` /
    ``args.loss_type`` that way.
    """
    import ast
    import textwrap

    names: list[str] = []
    nodes = [node for source in sources for node in ast.walk(ast.parse(textwrap.dedent(source)))]
    for node in nodes:
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        if not (isinstance(left, ast.Attribute) and left.attr == "loss_type"):
            continue
        for op, right in zip(node.ops, node.comparators):
            if not isinstance(op, (ast.Eq, ast.In)):
                continue
            items = right.elts if isinstance(right, (ast.List, ast.Tuple, ast.Set)) else [right]
            for item in items:
                if isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value not in names:
                    names.append(item.value)
    return tuple(names)


def check_no_shadowing(trl_names: tuple[str, ...], trl_version: str = "?") -> None:
    """Refuse to run when TRL itself defines a ``loss_type`` named like one of ours (ours would silently win)."""
    clash = [name for name in STALERL_LOSS_TYPES if name in trl_names]
    if clash:
        raise RuntimeError(f"recipe.trl: trl {trl_version} has its own loss_type {', '.join(map(repr, clash))}, "
                           "which stalerl's adapter would silently replace; the adapter must rename its loss before "
                           "it can run with this TRL. Fix: use trl>=1.16,<1.17, or trl.GRPOTrainer for TRL's own "
                           f"{clash[0]!r}")


def check_vllm_logprobs_mode(mode: Any, loss_type: str) -> None:
    """The sampler's log-probs are the behaviour policy of m2po/fipo: they must be after temperature / top-p."""
    if mode != "processed_logprobs":
        raise ValueError(f"recipe.trl: loss_type={loss_type!r} takes vLLM's sampling log-probs as the behaviour "
                         f"policy, but the vLLM server runs with --logprobs-mode {mode}, whose log-probs are before "
                         "temperature scaling and logit processing, so every ratio would be biased. Fix: restart the "
                         "server with `trl vllm-serve` or `vllm serve ... --logprobs-mode processed_logprobs`")


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
    from recipe.fipo.algorithm import fipo_params_from_config  # the losses' own rules (torch-only modules)
    from recipe.m2po.algorithm import m2_threshold_from_config

    rules = m2_threshold_from_config if loss == "m2po" else fipo_params_from_config
    try:
        rules(loss_config(args))
    except ValueError as err:
        message = str(err).replace("clip_ratio_low", "epsilon").replace("clip_ratio_high", "epsilon_high")
        raise ValueError(f"GRPOConfig.{message}") from None
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
    if getattr(args, "use_vllm", False):
        # The losses' log-ratio is taken against vLLM's sampling log-probs already; TRL's correction would weigh the
        # train/inference mismatch a second time (and costs a no-grad forward whose result nobody would use).
        refused += (("vllm_importance_sampling_correction", bool(args.vllm_importance_sampling_correction), "False",
                     "the loss's ratio is already taken against vLLM's sampling log-probs; TRL's correction would "
                     "count the sampler mismatch twice"),)
        for key, default in TRL_VLLM_IS_DEFAULTS.items():
            refused += ((key, getattr(args, key, default) != default, repr(default),
                         "it only configures TRL's importance-sampling correction, which these losses do not use"),)
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
