"""Does a loss's step change when the step is split into micro-batches? The arithmetic of that check, on a loss
function given (no registry lookup here, so the registry's probe and ``recipe.testing`` both use it without an
import cycle).

The step is the loss summed over its micro-batches (row slices of one batch), each call told the whole step's token
count through ``global_batch_info`` (verl's convention, ``recipe.common.agg_loss``); the gaps are the largest
differences of that sum and of its gradient between the one-call step and each split. A ``planner`` (what
``recipe.testing`` passes: ``plan_optimizer_batch``) adds a selector loss's per-micro-batch extras; without one,
only the token count is planned (enough for a loss whose step needs nothing else).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

#: A planner: (micro-batches as dicts of row-sliced tensors, config) -> (step tokens, dp size, extras per micro-batch).
Planner = Callable[[list, dict], "tuple[int, int, list[dict[str, Any]]]"]


def probe_batch(rows: int = 8, tokens: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small random float64 batch (behaviour and current log-probs, advantages per row, ragged padding).

    Padding positions hold NaN in the log-probs: a loss that multiplies padding by a mask instead of masking it out
    (``torch.where``) lets NaN into the gradient, and the check reports it."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, tokens, generator=g, dtype=torch.float64) * 2 - 0.05
    current = old + 0.3 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, tokens).clone()
    lengths = torch.randint(1, tokens + 1, (rows,), generator=g)
    mask = torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    current = torch.where(mask, current, torch.full_like(current, float("nan")))
    return {"old_log_prob": old, "log_prob": current, "advantages": adv, "response_mask": mask}


def _count_only(micro_batches: list, config: dict) -> tuple[int, int, list[dict[str, Any]]]:
    return sum(int(mb["response_mask"].bool().sum()) for mb in micro_batches), 1, [{} for _ in micro_batches]


def _step(fn: Callable, batch: Mapping[str, Any], parts: int, config: Mapping[str, Any], loss_agg_mode: str,
          planner: Planner) -> tuple[float, torch.Tensor]:
    """(loss, gradient w.r.t. log_prob) of one step split row-wise into ``parts`` micro-batches."""
    current = batch["log_prob"].detach().clone().requires_grad_(True)
    rows = batch["response_mask"].shape[0]
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    micro = [{"old_log_prob": batch["old_log_prob"][a:b], "log_prob": current[a:b],
              "advantages": batch["advantages"][a:b], "response_mask": batch["response_mask"][a:b]}
             for a, b in zip(bounds, bounds[1:]) if b > a]
    num_tokens, dp_size, extras = planner(micro, dict(config))
    call_config = dict(config)
    call_config["global_batch_info"] = {**dict(config.get("global_batch_info") or {}),
                                        "batch_num_tokens": int(num_tokens), "dp_size": int(dp_size)}
    total = torch.zeros((), dtype=torch.float64)
    for mb, extra in zip(micro, extras):
        value, _ = fn(**mb, loss_agg_mode=loss_agg_mode, config=call_config, rollout_is_weights=None, **extra)
        total = total + value.double()
    total.backward()
    grad = current.grad
    if bool(torch.isfinite(grad).all()):  # NaN/inf anywhere (padding included) is a failure, not masked away
        grad = torch.where(batch["response_mask"].bool(), grad, torch.zeros_like(grad))
    return float(total.detach()), grad


def split_gaps(fn: Callable, batch: Optional[Mapping[str, Any]] = None, splits: Sequence[int] = (1, 2, 4), *,
               config: Optional[Mapping[str, Any]] = None, loss_agg_mode: str = "token-mean",
               planner: Optional[Planner] = None) -> tuple[float, float, float, float]:
    """(largest |loss difference|, largest |gradient difference|) between the step of loss function ``fn`` as one
    call and each split, and the one call's (|loss|, largest |gradient|) to scale them by; the gaps are ``inf`` when
    a gradient is not finite."""
    batch = probe_batch() if batch is None else batch
    config, planner = dict(config or {}), planner or _count_only
    ref_loss, ref_grad = _step(fn, batch, 1, config, loss_agg_mode, planner)
    finite = bool(torch.isfinite(ref_grad).all())
    scale = (abs(ref_loss), float(ref_grad.abs().max()) if finite and ref_grad.numel() else 0.0)
    if not finite:
        return (float("inf"), float("inf"), *scale)
    worst = (0.0, 0.0)
    for parts in splits:
        if parts == 1:
            continue
        value, grad = _step(fn, batch, parts, config, loss_agg_mode, planner)
        if not bool(torch.isfinite(grad).all()):
            return (float("inf"), float("inf"), *scale)
        worst = (max(worst[0], abs(value - ref_loss)), max(worst[1], float((grad - ref_grad).abs().max())))
    return (*worst, *scale)


def is_split_invariant(gaps: tuple[float, float, float, float], *, rtol: float = 1e-5, atol: float = 1e-9) -> bool:
    """Whether :func:`split_gaps`' gaps are rounding: each at most ``atol + rtol * its scale`` (float32 arithmetic
    in a loss leaves ~1e-7 relative; aggregating per micro-batch leaves O(1))."""
    loss_gap, grad_gap, loss_scale, grad_scale = gaps
    return loss_gap <= atol + rtol * loss_scale and grad_gap <= atol + rtol * grad_scale


__all__ = ["Planner", "is_split_invariant", "probe_batch", "split_gaps"]
