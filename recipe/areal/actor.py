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
2. For a loss whose step needs a decision (its declaration's ``step``; ``recipe.registry.needs_step_log_probs``),
   the step plan (:func:`recipe.areal.packed.select_mini_batch`, i.e. ``recipe.optimizer_batch``): M2PO's selection
   over all the mini-batch's tokens and all ranks of the data-parallel group (``actor.m2_scope: local``: each
   rank's), FIPO's sequence drop; the plan's masks ride along in the mini-batch dict, so AReaL's micro-batching
   slices and packs them like the log-probs.
3. ``engine.train_batch`` with :func:`exact_loss_fn` per micro-batch and the valid-token count as the micro-batch
   weight, which makes AReaL's scaling give the registry's ``token-mean`` over the whole mini-batch.

M2PO's ratio uses AReaL's ``logprobs`` (the behaviour policy's, see :mod:`recipe.areal.rules` for the settings that
keep them so), never ``prox_logp``.

The exact path is proven at run time, because it rests on one fact of AReaL 1.0.4 (``_ppo_update`` calls
``self.engine.train_batch`` once per mini-batch): while the update runs, the real engine's ``train_batch`` refuses a
loss that is not :func:`exact_loss_fn` (a release that reaches the engine another way fails before its first
step), and after the update the actor checks that the view trained every mini-batch and the exact loss ran
(a release that trains some other way fails right after). AReaL's own M2PO is switched off in the actor
(``self.m2_threshold = None``: ``actor.m2_threshold`` is Algorithm 1's tau here), so it can never run instead.

Metrics: whatever keys the loss returns (``m2po/*``, ``fipo/*``, a plugin loss's own), unscoped, through AReaL's
stats tracker. Per optimizer step, the micro-batches' metrics are combined by ``recipe.declaration.reduce_metrics``
with the loss's declared rules (a batch selector's step-wide diagnostics, M2PO's selection, replace the loss's keys
of the same name, as in the runtime), and recorded as the numerators and denominators that make the tracker's export
(over all mini-batches and ranks of the train step) follow the same rules: :func:`record_metrics`, the one place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from areal.trainer.ppo.actor import PPOActor
from areal.utils import stats_tracker
from areal.utils.stats_tracker import ReduceType

from recipe.areal.packed import packed_policy_loss, select_mini_batch
from recipe.areal.rules import check_areal_version, check_exact_loss_config, loss_config, plans_over_group
from recipe.declaration import Metric, reduce_metrics, rule_for
from recipe.registry import get_policy_loss_spec, needs_step_log_probs

# AReaL's prox_logp methods that fill ``prox_logp`` by a forward pass of the current weights (not an approximation).
_RECOMPUTED_PROX = ("recompute", "metrics")


class ExactPathNotTaken(RuntimeError):
    """AReaL trained (or tried to) without the exact loss: its update loop no longer goes through the adapter."""


def valid_tokens(micro_batch: dict[str, Any]) -> torch.Tensor:
    """A micro-batch's weight for AReaL's loss scaling: its valid-token count (the registry loss divides by it)."""
    return micro_batch["loss_mask"].count_nonzero()


@dataclass
class _UpdateProof:
    """What one ``_ppo_update`` did through the adapter: mini-batches trained through the view, exact-loss calls."""

    mini_batches: int = 0
    loss_calls: int = 0


def record_metrics(values: dict[str, float], counts: dict[str, float], rules: dict[str, Metric], namespace: str, *,
                   weighted: bool = True) -> None:
    """One step's metrics (``values``, with the step's ``counts`` of ``valid_tokens`` and ``rows``) into AReaL's stats
    tracker, so that its export over the train step's mini-batches and ranks combines them by the declared ``rules``
    (undeclared keys by ``reduce_metrics``'s naming convention):

    - a mean weighted by ``w`` (a count: valid tokens, rows, or another metric of the loss such as
      ``fipo/num_kept_tokens``): AVG of the value over a denominator of ``w`` entries (``<namespace>/num_valid_tokens``,
      ``<namespace>/num_sequences``, or that metric's own key);
    - a sum (a count): a denominator of ``value`` entries under its own key, exported as their sum;
    - a max: MAX over the valid-token denominator.

    A denominator named like a declared count (``m2po/num_valid_tokens``) is that count. ``weighted=False``: the same
    keys with zero weight (another rank records the group's values once).
    """
    def entries(n: float) -> torch.Tensor:
        n = int(round(n)) if weighted else 0
        return torch.arange(max(n, 1)) < n  # AReaL refuses an empty denominator: one False entry for a zero count

    denominators: dict[str, torch.Tensor] = {}

    def denominator(weight: str) -> str:
        if weight in ("valid_tokens", "rows"):
            name = f"{namespace}/num_valid_tokens" if weight == "valid_tokens" else f"{namespace}/num_sequences"
            count = counts[weight]
        else:
            name, count = weight, values.get(weight, 0.0)
        if name not in denominators:
            denominators[name] = entries(count)
        return name

    stats: list[tuple[str, Any, str]] = []
    for key, value in values.items():
        rule = rule_for(key, rules)
        if rule.combine == "sum":
            denominators.setdefault(key, entries(value))
        elif rule.combine == "max":
            stats.append((key, ReduceType.MAX, denominator("valid_tokens")))
        else:
            stats.append((key, ReduceType.AVG, denominator(rule.weight)))
    with stats_tracker.DEFAULT_TRACKER.disable_scope():  # names exactly the loss's keys
        stats_tracker.denominator(**denominators)
        for key, reduce_type, name in stats:
            stats_tracker.stat(**{key: torch.full(denominators[name].shape, float(values[key]))}, denominator=name,
                               reduce_type=reduce_type)


def _micro_batch_counts(input_data: dict[str, Any]) -> dict[str, float]:
    return {"valid_tokens": float(input_data["loss_mask"].bool().sum()),
            "rows": float(input_data["cu_seqlens"].numel() - 1)}


def exact_loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, input_data: dict[str, Any], *, loss_name: str,
                  config: Any, step_scale: float = 1.0, proof: Optional[_UpdateProof] = None,
                  parts: Optional[list] = None, **_engine_extras: Any) -> torch.Tensor:
    """The loss AReaL's engine calls per packed micro-batch (its ``loss_fn`` signature), with AReaL's statistics.

    ``parts`` collects ``(counts, metrics)`` per micro-batch; the actor combines them per optimizer step
    (:func:`record_metrics`). ``_engine_extras`` takes what engines pass besides (``vocab_min_logits`` /
    ``vocab_max_logits``), unused here.
    """
    if proof is not None:
        proof.loss_calls += 1
    if input_data.get("teacher_logp") is not None:
        raise ValueError("teacher distillation (teacher_logp in the batch) is part of AReaL's own loss only; "
                         "unset actor.loss or the teacher")
    loss, metrics, kept = packed_policy_loss(loss_name, logprobs, input_data, config, step_scale=step_scale)
    with torch.no_grad():
        mask = input_data["loss_mask"].bool()
        old = input_data["logprobs"].detach().float()
        new = logprobs.detach().float()
        stats_tracker.denominator(n_valid_tokens=mask, kept_tokens=kept.bool() & mask)
        stats_tracker.stat(importance_weight=torch.exp((new - old).clamp(-20, 20)), log_ratio=new - old,
                           new_logp=new, old_logp=old, entropy=entropy.detach().float(),
                           denominator="n_valid_tokens")
        if parts is not None:
            parts.append((_micro_batch_counts(input_data), {k: float(v) for k, v in metrics.items()}))
    return loss


class _ExactLossEngineView:
    """The engine as ``PPOActor._ppo_update`` sees it during an exact update: all attributes are the engine's,
    except ``train_batch``, which selects over the mini-batch and swaps in the exact loss."""

    def __init__(self, engine: Any, actor: "ExactLossPPOActor", proof: _UpdateProof) -> None:
        self._engine = engine
        self._actor = actor
        self._proof = proof

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def train_batch(self, input_: dict[str, Any], loss_fn: Any = None, loss_weight_fn: Any = None) -> dict:
        index = self._proof.mini_batches
        self._proof.mini_batches += 1
        return self._actor.train_mini_batch(self._engine, input_, first=index == 0)


def _is_exact_loss(loss_fn: Any) -> bool:
    return isinstance(loss_fn, functools.partial) and loss_fn.func is exact_loss_fn


def _moved_loop_message(loss_name: str, what: str) -> str:
    return (f"recipe.areal: {what}: this AReaL release no longer trains through PPOActor._ppo_update -> "
            f"engine.train_batch (areal 1.0.4's loop), so actor.loss={loss_name} would not be the loss trained; "
            "stopped instead of falling back to AReaL's own loss. Fix: install the tested AReaL "
            "(python -m recipe.versions ci areal), or unset actor.loss")


class _GuardedTrainBatch:
    """Installed on the real engine during an exact update: ``train_batch`` with anything but the exact loss (AReaL's
    ``grpo_loss_fn`` reaching the engine some other way) is refused before any work."""

    def __init__(self, engine: Any, loss_name: str, own: Any = None) -> None:
        self._train_batch = own if own is not None else type(engine).train_batch.__get__(engine)
        self._loss_name = loss_name

    def __call__(self, input_: dict[str, Any], loss_fn: Any = None, loss_weight_fn: Any = None, **kwargs: Any):
        if not _is_exact_loss(loss_fn):
            name = getattr(getattr(loss_fn, "func", loss_fn), "__name__", repr(loss_fn))
            raise ExactPathNotTaken(_moved_loop_message(self._loss_name,
                                                        f"engine.train_batch was called with {name}, not the exact "
                                                        "loss, bypassing the adapter's view of the engine"))
        return self._train_batch(input_, loss_fn=loss_fn, loss_weight_fn=loss_weight_fn, **kwargs)


class ExactLossPPOActor(PPOActor):
    """AReaL's ``PPOActor`` with ``config.loss`` (a ``recipe.registry`` name) as its policy loss; unset: AReaL's."""

    def __init__(self, config: Any, engine: Any) -> None:
        check_areal_version()
        check_exact_loss_config(config)
        super().__init__(config, engine)
        self.loss_name: Optional[str] = getattr(config, "loss", None)
        if self.loss_name is not None:
            # AReaL's own M2PO reads this attribute inside grpo_loss_fn; actor.m2_threshold is Algorithm 1's tau
            # here (read from the config by the registry), so AReaL's variant must never see it.
            self.m2_threshold = None
        self._proof: Optional[_UpdateProof] = None

    def _ppo_update(self, data: dict[str, Any]) -> None:
        if self.loss_name is None:
            super()._ppo_update(data)
            return
        engine = self.engine
        proof = _UpdateProof()
        self._proof = proof
        own = vars(engine).get("train_batch", None) if hasattr(engine, "__dict__") else None
        engine.train_batch = _GuardedTrainBatch(engine, self.loss_name, own)
        self.engine = _ExactLossEngineView(engine, self, proof)
        try:
            super()._ppo_update(data)
        finally:
            self.engine = engine
            self._proof = None
            if own is None:
                del engine.train_batch
            else:
                engine.train_batch = own
        self.check_exact_path_taken(proof, data)

    def check_exact_path_taken(self, proof: _UpdateProof, data: dict[str, Any]) -> None:
        """After an update: it went through the view, and the exact loss ran (unless no token was valid)."""
        if proof.mini_batches == 0:
            raise ExactPathNotTaken(_moved_loop_message(
                self.loss_name, "PPOActor._ppo_update returned without calling the adapter's engine.train_batch"))
        if proof.loss_calls == 0 and bool(data["loss_mask"].bool().any()):
            raise ExactPathNotTaken(_moved_loop_message(
                self.loss_name, f"the engine trained {proof.mini_batches} mini-batch(es) without calling the "
                                "exact loss"))

    # ------------------------------------------------------------------------------------------------- one step

    def train_mini_batch(self, engine: Any, mini_batch: dict[str, Any], *, first: bool) -> dict:
        """One optimizer step on one PPO mini-batch (AReaL's ``train_batch``), with the exact loss, and its metrics
        (the micro-batches' combined by the declared rules; a batch selector's step-wide diagnostics instead of the
        loss's own keys)."""
        assert self.loss_name is not None
        spec = get_policy_loss_spec(self.loss_name)
        config = loss_config(self.config, self.loss_name)
        step_scale, decided, group = 1.0, None, None
        if needs_step_log_probs(self.loss_name):
            current = self.current_logprobs(engine, mini_batch, first=first)
            if engine.data_parallel_world_size > 1 and plans_over_group(self.config, self.loss_name):
                group = engine.data_parallel_group
            decided = select_mini_batch(self.loss_name, mini_batch, current, config, group=group,
                                        device=getattr(engine, "device", None))
            step_scale = decided.step_scale
        parts: list = []
        loss_fn = functools.partial(exact_loss_fn, loss_name=self.loss_name, config=config, step_scale=step_scale,
                                    proof=self._proof, parts=parts)
        stats = engine.train_batch(mini_batch, loss_fn=loss_fn, loss_weight_fn=valid_tokens)
        rules = dict(spec.declaration.metrics)
        local = reduce_metrics(parts, rules)
        selection = decided.selection if decided is not None else None
        if selection is None:
            counts = {k: sum(c[k] for c, _ in parts) for k in ("valid_tokens", "rows")}
            record_metrics(local, counts, rules, self.loss_name)
        else:  # the selection's metrics are the group's (all ranks): its first rank records them, with its counts
            plan = decided.plan
            owner = group is None or torch.distributed.get_rank(group) == 0
            record_metrics({**local, **selection.metrics()},
                           {"valid_tokens": plan.num_tokens, "rows": plan.num_rows or 0}, rules, self.loss_name,
                           weighted=owner)
        return stats

    def current_logprobs(self, engine: Any, mini_batch: dict[str, Any], *, first: bool) -> torch.Tensor:
        """The current weights' log-probs of the mini-batch's tokens, ``(B, T)`` like its ``loss_mask``.

        AReaL's ``prox_logp`` for the first mini-batch when it was computed by a forward of these weights
        (``recompute``, ``metrics``); otherwise (``loglinear`` approximates it; later mini-batches follow an
        optimizer step) one no-grad forward.
        """
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
