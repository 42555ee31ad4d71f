"""Helpers for testing a policy loss (this repository's and a plugin author's): split invariance and a scratch
registry.

- :func:`assert_split_invariant` -- the loss and its gradient of one optimizer step are the same whether the step is
  one call or split into 2, 4, ... micro-batches planned with :func:`recipe.optimizer_batch.plan_optimizer_batch`
  (one selection and one token count per step). A loss that aggregates per micro-batch instead of with
  ``recipe.common.agg_loss(..., **global_batch_info(config))`` fails it.
- :func:`split_gradient_gap` -- the same comparison as numbers (the arithmetic is :mod:`recipe.split_probe`, which
  the registry's probe of a plugin loss uses too).
- :func:`registry_state` -- a context manager that saves the registry's whole state and puts it back (a test that
  registers a loss leaves nothing behind).

``import recipe.testing`` is torch-free; the split helpers import torch when called.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Sequence


@contextlib.contextmanager
def registry_state() -> Iterator[Any]:
    """Save ``recipe.registry``'s whole state, yield it, and restore it on exit."""
    from recipe import registry

    saved = registry.snapshot()
    try:
        yield registry._STATE
    finally:
        registry.restore(saved)


def _planner(loss: str) -> Any:
    """``plan_optimizer_batch`` of loss ``loss`` as a :mod:`recipe.split_probe` planner (the selection and token
    count the runtime and every adapter plan for a split step)."""
    from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch

    def plan(micro_batches: list, config: dict) -> tuple[int, int, list]:
        plan = plan_optimizer_batch(loss, [MicroBatch(**mb) for mb in micro_batches], config)
        return plan.num_tokens, plan.dp_size, plan.extras

    return plan


def split_gradient_gap(loss: str, batch: Optional[Mapping[str, Any]] = None, splits: Sequence[int] = (1, 2, 4), *,
                       config: Optional[Mapping[str, Any]] = None,
                       loss_agg_mode: str = "token-mean") -> tuple[float, float, float, float]:
    """:func:`recipe.split_probe.split_gaps` of registered loss ``loss``, its split steps planned with
    ``plan_optimizer_batch``: (loss gap, gradient gap, |loss|, largest |gradient|)."""
    from recipe.registry import get_policy_loss_fn
    from recipe.split_probe import split_gaps

    return split_gaps(get_policy_loss_fn(loss), batch, splits, config=config, loss_agg_mode=loss_agg_mode,
                      planner=_planner(loss))


def probe_batch(rows: int = 8, tokens: int = 12, seed: int = 0) -> dict[str, Any]:
    """A small random float64 batch whose padding holds NaN (:func:`recipe.split_probe.probe_batch`)."""
    from recipe.split_probe import probe_batch as make

    return make(rows, tokens, seed)


def is_split_invariant(gaps: tuple[float, float, float, float], *, rtol: float = 1e-5, atol: float = 1e-9) -> bool:
    """Whether the gaps are rounding (:func:`recipe.split_probe.is_split_invariant`)."""
    from recipe.split_probe import is_split_invariant as check

    return check(gaps, rtol=rtol, atol=atol)


def assert_split_invariant(loss: str, batch: Optional[Mapping[str, Any]] = None, splits: Sequence[int] = (1, 2, 4),
                           *, config: Optional[Mapping[str, Any]] = None, loss_agg_mode: str = "token-mean",
                           rtol: float = 1e-5, atol: float = 1e-9) -> None:
    """Assert that registered loss ``loss`` gives the same step loss and gradient whether ``batch`` (a dict of
    ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask``, all ``(rows, tokens)``; default
    :func:`probe_batch`) is one call or split row-wise into each of ``splits`` micro-batches, planned with
    ``plan_optimizer_batch`` (the way the runtime and every adapter split a step), up to rounding
    (:func:`is_split_invariant`)."""
    gaps = split_gradient_gap(loss, batch, splits, config=config, loss_agg_mode=loss_agg_mode)
    if not is_split_invariant(gaps, rtol=rtol, atol=atol):
        loss_gap, grad_gap = gaps[:2]
        raise AssertionError(
            f"policy loss {loss!r} is not split-invariant: over splits {tuple(splits)} the step's loss differs by "
            f"{loss_gap:.3g} (of {gaps[2]:.3g}) and its gradient by {grad_gap:.3g} (of {gaps[3]:.3g}); "
            + ("a gradient is not finite: mask padding with torch.where before multiplying (NaN * 0 is NaN)"
               if grad_gap == float("inf") else
               "aggregate with recipe.common.agg_loss(..., **global_batch_info(config)), not per micro-batch"))


__all__ = ["assert_split_invariant", "is_split_invariant", "probe_batch", "registry_state", "split_gradient_gap"]
