"""``ExactLossPPOActor``: AReaL's ``PPOActor`` whose PPO update computes a ``recipe.registry`` loss exactly.

AReaL's own ``PPOActor._ppo_update`` runs unchanged (its statistics, its split into ``ppo_n_minibatches`` optimizer
mini-batches, its call of ``engine.train_batch`` per mini-batch, the engine's micro-batching and packing). Only the
loss that reaches the engine differs: while the update runs, the actor sees its engine through
:class:`_ExactLossEngineView`, whose ``train_batch`` first selects over the whole mini-batch (M2PO's Algorithm 1,
across data-parallel ranks), then hands the engine the registry's loss instead of AReaL's ``grpo_loss_fn``.

Per mini-batch (one optimizer step):

1. The current policy's log-probs of every token of the mini-batch, without gradient: AReaL's recomputed
   ``prox_logp`` for the first mini-batch when it holds them (same weights: AReaL computes it just before the
   update), else one ``engine.forward`` (later mini-batches follow an optimizer step, so they need their own).
2. The selection (:func:`recipe.areal.packed.select_mini_batch`): one call of the registry's batch selector over
   all the mini-batch's tokens and all ranks of the data-parallel group; the keep mask rides along in the mini-batch
   dict, so AReaL's micro-batching slices and packs it like the log-probs.
3. ``engine.train_batch`` with :func:`exact_loss_fn` per micro-batch and the valid-token count as the micro-batch
   weight, which makes AReaL's scaling give the registry's ``token-mean`` over the whole mini-batch.

M2PO's ratio uses AReaL's ``logprobs`` (the behaviour policy's, see :mod:`recipe.areal.rules` for the settings that
keep them so), never ``prox_logp``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from areal.trainer.ppo.actor import PPOActor
from areal.utils import stats_tracker

from recipe.areal.packed import packed_policy_loss, select_mini_batch
from recipe.areal.rules import check_exact_loss_config
from recipe.registry import get_batch_selector

# AReaL's prox_logp methods that fill ``prox_logp`` by a forward pass of the current weights (not an approximation).
_RECOMPUTED_PROX = ("recompute", "metrics")


def valid_tokens(micro_batch: dict[str, Any]) -> torch.Tensor:
    """A micro-batch's weight for AReaL's loss scaling: its valid-token count (the registry loss divides by it)."""
    return micro_batch["loss_mask"].count_nonzero()


def exact_loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, input_data: dict[str, Any], *, loss_name: str,
                  config: Any, log_loss_metrics: bool = True, **_engine_extras: Any) -> torch.Tensor:
    """The loss AReaL's engine calls per packed micro-batch (its ``loss_fn`` signature), with AReaL's statistics.

    ``_engine_extras`` takes what engines pass besides (``vocab_min_logits`` / ``vocab_max_logits``), unused here.
    """
    if input_data.get("teacher_logp") is not None:
        raise ValueError("teacher distillation (teacher_logp in the batch) is part of AReaL's own loss only; "
                         "unset actor.loss or the teacher")
    loss, metrics, kept = packed_policy_loss(loss_name, logprobs, input_data, config)
    with torch.no_grad():
        mask = input_data["loss_mask"].bool()
        old = input_data["logprobs"].detach().float()
        new = logprobs.detach().float()
        stats_tracker.denominator(n_valid_tokens=mask, kept_tokens=kept.bool() & mask)
        stats_tracker.stat(importance_weight=torch.exp((new - old).clamp(-20, 20)), log_ratio=new - old,
                           new_logp=new, old_logp=old, entropy=entropy.detach().float(),
                           denominator="n_valid_tokens")
        if log_loss_metrics:
            stats_tracker.scalar(**metrics)
    return loss


class _ExactLossEngineView:
    """The engine as ``PPOActor._ppo_update`` sees it during an exact update: all attributes are the engine's,
    except ``train_batch``, which selects over the mini-batch and swaps in the exact loss."""

    def __init__(self, engine: Any, actor: "ExactLossPPOActor") -> None:
        self._engine = engine
        self._actor = actor
        self._mini_batches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def train_batch(self, input_: dict[str, Any], loss_fn: Any = None, loss_weight_fn: Any = None) -> dict:
        index = self._mini_batches
        self._mini_batches += 1
        return self._actor.train_mini_batch(self._engine, input_, first=index == 0)


class ExactLossPPOActor(PPOActor):
    """AReaL's ``PPOActor`` with ``config.loss`` (a ``recipe.registry`` name) as its policy loss; unset: AReaL's."""

    def __init__(self, config: Any, engine: Any) -> None:
        check_exact_loss_config(config)
        super().__init__(config, engine)
        self.loss_name: Optional[str] = getattr(config, "loss", None)

    def _ppo_update(self, data: dict[str, Any]) -> None:
        if self.loss_name is None:
            super()._ppo_update(data)
            return
        engine = self.engine
        self.engine = _ExactLossEngineView(engine, self)
        try:
            super()._ppo_update(data)
        finally:
            self.engine = engine

    # ------------------------------------------------------------------------------------------------- one step

    def train_mini_batch(self, engine: Any, mini_batch: dict[str, Any], *, first: bool) -> dict:
        """One optimizer step on one PPO mini-batch (AReaL's ``train_batch``), with the exact loss."""
        assert self.loss_name is not None
        has_selector = get_batch_selector(self.loss_name) is not None
        if has_selector:
            current = self.current_logprobs(engine, mini_batch, first=first)
            group = engine.data_parallel_group if engine.data_parallel_world_size > 1 else None
            plan = select_mini_batch(self.loss_name, mini_batch, current, self.config, group=group,
                                     device=getattr(engine, "device", None))
            if plan.selection is not None:
                stats_tracker.scalar(**plan.selection.metrics())
        loss_fn = functools.partial(exact_loss_fn, loss_name=self.loss_name, config=self.config,
                                    log_loss_metrics=not has_selector)
        return engine.train_batch(mini_batch, loss_fn=loss_fn, loss_weight_fn=valid_tokens)

    def current_logprobs(self, engine: Any, mini_batch: dict[str, Any], *, first: bool) -> torch.Tensor:
        """The current weights' log-probs of the mini-batch's tokens, ``(B, T)`` like its ``loss_mask``."""
        width = mini_batch["loss_mask"].shape[1]
        prox = mini_batch.get("prox_logp")
        method = getattr(self.config, "prox_logp_method", "recompute")
        if first and prox is not None and self.config.should_compute_prox_logp() and method in _RECOMPUTED_PROX:
            return prox.detach()
        engine.eval()
        try:
            out = engine.forward(input_=mini_batch, aggregate_fn=lambda xs: torch.cat(xs, dim=-1))
        finally:
            engine.train()
        if out.shape[1] < width:  # AReaL pads the outputs to the longest sequence, the batch may be wider
            out = torch.nn.functional.pad(out, (0, width - out.shape[1]))
        return out
