"""Pieces every policy loss here shares: reading config, verl-exact loss aggregation, input guards.

Values are read and checked by the declarations (``LossDeclaration.read``, ``read_clip``: one validation,
``Param.check``); the readers here only find a key.

Pure torch. ``config`` may be a verl ``ActorConfig`` dataclass, an OmegaConf ``DictConfig``, a plain dict, an
object with attributes, or None; every reader accepts all of them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.declaration import _MISSING, _get as _config_get, _lookup as _config_lookup
from recipe.registry import LOSS_AGG_MODES  # noqa: E402 - defined torch-free there for config validation

# The log-ratio is clamped to +-LOG_RATIO_CLAMP before exp(), as verl does, with torch.clamp's gradient: a token with
# |d| > 20 (r > 4.8e8 or < 2.1e-9) contributes nothing to the gradient. Such a token is far outside any trust region;
# passing the gradient straight through would give it a weight of |A| e^20 and let one token dominate the update.
LOG_RATIO_CLAMP = 20.0



def cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` or ``config[key]``; ``default`` when absent or None (recipe.declaration reads configs the same
    way)."""
    value = _config_get(config, key)
    return default if value is _MISSING else value


def cfg_lookup(config: Any, paths: tuple[str, ...], default: Any) -> tuple[Any, str]:
    """First present value among dotted ``paths`` (e.g. ``policy_loss.m2_threshold``); returns (value, path)."""
    value, path = _config_lookup(config, paths)
    return (default, paths[-1]) if value is _MISSING else (value, path)


def global_batch_info(config: Any) -> dict[str, Any]:
    """verl's ``config.global_batch_info`` (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)."""
    info = cfg_get(config, "global_batch_info", None)
    if not info:
        return {}
    return {k: info[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
            if k in info and info[k] is not None}


def _as_float_tensor(x: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=like.device, dtype=like.dtype)
    return torch.tensor(float(x), device=like.device, dtype=like.dtype)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *, dp_size: int = 1,
             batch_num_tokens: Optional[Any] = None, global_batch_size: Optional[Any] = None,
             loss_scale_factor: Optional[Any] = None) -> torch.Tensor:
    """Aggregate a per-token loss exactly as verl's ``agg_loss`` does, so DP and micro-batch splits are exact.

    One difference, on purpose: an empty batch (zero valid tokens or sequences) returns a zero connected to the graph
    instead of dividing by zero.
    """
    mask = loss_mask.to(loss_mat.dtype)
    # torch.where, not a product: garbage (NaN/inf) at padded positions must not leak into the sum or its gradient.
    masked = torch.where(loss_mask.bool(), loss_mat, torch.zeros_like(loss_mat))
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("token-mean with dp_size > 1 needs the global batch_num_tokens "
                                 "(config.global_batch_info['batch_num_tokens'])")
            batch_num_tokens = mask.sum()
        denom = torch.clamp(_as_float_tensor(batch_num_tokens, masked), min=1.0)
        return masked.sum() / denom * dp_size
    if loss_agg_mode == "token-sum":
        return masked.sum() * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        token_count = mask.sum(dim=-1)
        seq_losses = masked.sum(dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (token_count + 1e-8)
        seq_mask = (token_count > 0).to(masked.dtype)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"{loss_agg_mode} with dp_size > 1 needs the global global_batch_size "
                                 "(config.global_batch_info['global_batch_size'])")
            global_batch_size = seq_mask.sum()
        denom = torch.clamp(_as_float_tensor(global_batch_size, masked), min=1.0)
        loss = (seq_losses * seq_mask).sum() / denom * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            # default: the padded width (verl); at least 1, so a zero-width empty batch gives 0, not 0/0
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else max(loss_mask.shape[-1], 1))
        return loss
    raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}; got {loss_agg_mode!r}")


class NonFiniteLogProbError(ValueError):
    """A loss was handed non-finite log-probs or advantages on valid tokens: the run has diverged (or its rollout
    engine's log-probs are broken). A ValueError, so callers that catch those still do; a trainer tells divergence
    apart by this type, never by the message."""


def check_inputs(name: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, rollout_is_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Validate shapes and finiteness on valid tokens; returns the boolean valid mask.

    Non-finite values on padding are fine (engines leave garbage there); on valid tokens they are an error that says
    how many and where, because silently dropping them corrupts the update.
    """
    shape = response_mask.shape
    if response_mask.dim() != 2:
        raise ValueError(f"{name}: response_mask must be (batch, response_len), got shape {tuple(shape)}")
    for label, t in (("old_log_prob", old_log_prob), ("log_prob", log_prob), ("advantages", advantages),
                     ("rollout_is_weights", rollout_is_weights)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name}: {label} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                             "(the shape of response_mask)")
    valid = response_mask.bool()
    if valid.numel() == 0:
        return valid
    with torch.no_grad():
        # Fast path: a NaN or inf on a valid token makes that tensor's masked sum non-finite, so three masked sums
        # (one pass each, one host sync) clear the common case. A non-finite sum (a bad value, or a finite overflow)
        # goes to the exact per-token count below, which alone decides and words the error.
        zero = torch.zeros((), device=valid.device)
        sums = torch.stack([torch.where(valid, t.detach(), zero).sum(dtype=torch.float32)
                            for t in (log_prob, old_log_prob, advantages)])
        if bool(torch.isfinite(sums).all()):
            return valid
        bad_parts = [~torch.isfinite(t.detach()) & valid for t in (log_prob, old_log_prob, advantages)]
        counts = torch.stack([b.sum() for b in bad_parts]).tolist()  # one host sync for all three
    if any(counts):
        where = []
        for label, bad, n in zip(("log_prob", "old_log_prob", "advantages"), bad_parts, counts):
            if n:
                first = bad.nonzero()[0].tolist()
                where.append(f"{label}: {n} (first at row {first[0]}, token {first[1]})")
        hint = ("check the rollout engine's behaviour log-probs (a token sampled outside top-k/top-p has -inf "
                "log-prob: sample with top_k=0, top_p=1) and the reward/advantage normalisation (0/0 gives NaN)")
        raise NonFiniteLogProbError(f"{name}: non-finite values on valid tokens: {'; '.join(where)}; {hint}")
    return valid


def clamp_log_ratio(x: torch.Tensor, bound: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """clamp(x, -bound, bound) with torch.clamp's gradient: 1 inside [-bound, bound] (bounds included), 0 beyond
    (verl's choice; see LOG_RATIO_CLAMP)."""
    return x.clamp(-bound, bound)


def masked_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log(pi_theta/pi_behaviour) in fp32, zero (and gradient-free) on padding."""
    d = log_prob.float() - old_log_prob.detach().float()
    return torch.where(valid, d, torch.zeros((), dtype=d.dtype, device=d.device))


def ppo_clip_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                       dual_clip: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, with verl's dual clip for A < 0 when ``dual_clip`` (c > 1) is given.

    Returns ``(per_token_loss, clipped, dual_clipped)``: the loss max(-A r, -A clip(r, 1-eps_low, 1+eps_high)),
    capped at -A c where A < 0, and the masks of the tokens the clip and the dual clip decided."""
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_clipped = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    return per_token, clipped, dual_clipped

