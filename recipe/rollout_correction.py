"""Rollout correction: importance weights and rejection for the gap between the rollout engine and the trainer.

Torch, imported on first use: the module itself loads without it, so a config validates its mode against
:data:`MODES` without importing torch. The engine that samples (vLLM, HF generate, bf16 kernels) and the trainer that recomputes log-probs at
the same weights (the "old" policy of the loss) never agree exactly; rollout correction reweights or drops tokens by
that gap before any policy loss runs, so it composes with every loss (verl's rollout correction, TRL's and
ms-swift's importance-sampling modes). With

    rho_t = exp(trainer_logp_t - engine_logp_t)          (per valid token; trainer = pi_old, engine = pi_rollout)

:func:`correction_weights` returns ``(weights, keep)``: ``weights`` detached, 1 where nothing is reweighted and 0 on
padding; ``keep`` the valid tokens that stay in the loss. Modes:

- ``none``: weights 1, every valid token kept.
- ``tis_token``: w_t = min(rho_t, threshold) (truncated importance sampling per token).
- ``tis_seq``: w = min(exp(sum_t log rho_t), threshold) on every token of the row.
- ``rs_token``: keep only tokens with low <= rho_t <= high; w = 1.
- ``rs_seq``: keep a row only when low <= exp(sum_t log rho_t) <= high; w = 1.
- ``rs_geo``: keep a row only when low <= exp(mean_t log rho_t) <= high (the geometric mean); w = 1.
- ``icepop``: keep tokens with low <= rho_t <= high, w_t = rho_t.

Rejected tokens leave the loss mask (the caller passes ``response_mask & keep`` to the loss), so they leave the
denominator too: with ``token-mean`` a step divides by the kept tokens, with ``seq-mean-*`` a row with no kept token
is no longer a row of the step (tests/unit/test_rollout_correction.py states both). Everything is per token or per row,
so splitting a batch into micro-batches or ranks by rows cannot change it. The sequence modes compare and clip in log
space (exp(min(s, log threshold)), log low <= s <= log high), so a long row's sum never overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

#: Each mode and what it does (the config's help is generated from this; a new mode is one entry here, its branch
#: in correction_weights, its test and its line in docs/algorithms/rollout_correction.md).
MODE_HELP = {
    "none": "nothing is corrected",
    "tis_token": "w = min(rho, threshold) per token",
    "tis_seq": "min(row rho, threshold) on the row (row rho = exp(sum log rho))",
    "rs_token": "drop tokens with rho outside [low, high]",
    "rs_seq": "drop rows whose row rho is outside [low, high]",
    "rs_geo": "the same on the row's geometric mean",
    "icepop": "keep tokens with rho in [low, high], weighted by rho",
}
MODES = tuple(MODE_HELP)
DEFAULT_THRESHOLD = 2.0
DEFAULT_LOW = 0.5
DEFAULT_HIGH = 5.0
METRIC_KEYS = ("rollout_correction/rejected_fraction", "rollout_correction/weight_mean",
               "rollout_correction/weight_max", "rollout_correction/kl_k1", "rollout_correction/kl_k3")


@dataclass(frozen=True)
class CorrectionParams:
    """One rollout-correction setting (validated on construction: one line naming the value and the fix)."""

    mode: str = "none"
    threshold: float = DEFAULT_THRESHOLD
    low: float = DEFAULT_LOW
    high: float = DEFAULT_HIGH

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout_correction.mode={self.mode!r}; expected one of {', '.join(MODES)}. "
                             "Fix: set rollout_correction.mode=tis_token (or none)")
        if not (self.threshold > 0 and math.isfinite(self.threshold)):
            raise ValueError(f"rollout_correction.threshold={self.threshold!r}; expected a finite number > 0. "
                             f"Fix: set rollout_correction.threshold={DEFAULT_THRESHOLD}")
        if not (0 <= self.low < self.high and math.isfinite(self.high)):
            raise ValueError(f"rollout_correction.low={self.low!r}, high={self.high!r}; expected 0 <= low < high < "
                             f"inf. Fix: set rollout_correction.low={DEFAULT_LOW} rollout_correction.high="
                             f"{DEFAULT_HIGH}")

    @property
    def active(self) -> bool:
        return self.mode != "none"


def _log_bounds(low: float, high: float) -> tuple[float, float]:
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def correction_weights(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       threshold: float = DEFAULT_THRESHOLD, low: float = DEFAULT_LOW,
                       high: float = DEFAULT_HIGH) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, keep)`` for (rows, tokens) tensors; see the module doc. Padding may hold anything (NaN too).
    Everything is computed from detached inputs: the weights carry no gradient."""
    import torch
    params = CorrectionParams(mode, float(threshold), float(low), float(high))
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    # log rho on valid tokens, 0 elsewhere (torch.where: padding's garbage never reaches a sum)
    log_rho = torch.where(valid, trainer_logp.detach().float() - engine_logp.detach().float(), zero)
    ones = valid.float()
    if params.mode == "none":
        return ones, valid.clone()
    log_lo, log_hi = _log_bounds(params.low, params.high)
    if params.mode == "tis_token":
        w = torch.exp(torch.clamp(log_rho, max=math.log(params.threshold)))
        return torch.where(valid, w, zero), valid.clone()
    if params.mode in ("rs_token", "icepop"):
        keep = valid & (log_rho >= log_lo) & (log_rho <= log_hi)
        w = torch.exp(log_rho) if params.mode == "icepop" else torch.ones_like(log_rho)
        return torch.where(keep, w, zero), keep
    row_sum = log_rho.sum(dim=-1, keepdim=True, dtype=torch.float64)
    if params.mode == "tis_seq":
        w = torch.exp(torch.clamp(row_sum, max=math.log(params.threshold))).float()
        return torch.where(valid, w.expand_as(log_rho), zero), valid.clone()
    if params.mode == "rs_seq":
        stat = row_sum
    else:  # rs_geo: the mean log-ratio of the row's valid tokens
        stat = row_sum / valid.sum(dim=-1, keepdim=True).clamp(min=1).double()
    row_ok = (stat >= log_lo) & (stat <= log_hi)
    keep = valid & row_ok
    return torch.where(keep, torch.ones_like(log_rho), zero), keep


def correction_metrics(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                       weights: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Over the tokens given (the runtime: one optimizer mini-batch, computed once before it is split): the share of
    valid tokens rejected, the weight's mean and max over the kept tokens, and the engine-vs-trainer KL estimated on
    the engine's samples over the valid tokens, k1 = mean(engine - trainer) and k3 = mean(rho - 1 - log rho)."""
    import torch
    valid = mask.bool()
    n = max(int(valid.sum()), 1)
    kept = keep.bool() & valid
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    log_rho = torch.where(valid, trainer_logp.detach().double() - engine_logp.detach().double(), zero)
    k3 = torch.where(valid, torch.expm1(log_rho) - log_rho, zero)
    w = weights.detach().double()
    n_kept = max(int(kept.sum()), 1)
    stats = torch.stack([
        (valid & ~kept).sum().double() / n,
        torch.where(kept, w, zero).sum() / n_kept,
        torch.where(kept, w, zero).max() if kept.any() else zero,
        -log_rho.sum() / n,
        k3.sum() / n,
    ]).tolist()
    return dict(zip(METRIC_KEYS, stats))


def apply_correction(trainer_logp: torch.Tensor, engine_logp: Optional[torch.Tensor], mask: torch.Tensor,
                     params: CorrectionParams) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """The runtime's step before the loss: ``(rollout_is_weights or None, loss_mask, metrics)``. With mode ``none``
    nothing is computed: no weights, the mask as given, no metrics (the loss then runs exactly as without it)."""
    if not params.active:
        return None, mask, {}
    if engine_logp is None:
        raise ValueError(f"rollout_correction.mode={params.mode} needs the engine's log-probs beside the trainer's; "
                         "this batch has none. Fix: set actor.behavior_logp=recompute")
    weights, keep = correction_weights(trainer_logp, engine_logp, mask, params.mode, params.threshold, params.low,
                                       params.high)
    return weights, keep & mask.bool(), correction_metrics(trainer_logp, engine_logp, mask, weights, keep)
