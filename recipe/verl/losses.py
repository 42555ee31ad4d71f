"""FIPO as verl calls it: exact on a step that is one loss call, refused on a split step (or an explicit opt-in).

verl's ``ppo_loss`` calls the policy loss once per micro-batch per GPU, with ``config.global_batch_info`` holding the
mini-batch's ``batch_num_tokens``: every valid token over all micro-batches and ranks, counted before the loss.
FIPO's objective (recipe/fipo/algorithm.py) leaves a dropped row out of the numerator *and* the denominator of the
whole optimizer step, and a row's drop is known only to the call that holds it. The registry's ``fipo`` is exact with
such a count where it can be (the step is its own call: ``dp_size`` 1 and the count its own valid tokens) and
refuses a count it cannot be exact with. What this wrapper adds is verl's side of that:

- **one call per optimizer step**: the registry's FIPO, as is (it is the reference there);
- **a split step** (several micro-batches, or several data-parallel ranks): refused at the first loss call, whether
  or not that call drops a row, before the first update, with one line naming the verl settings that make the step
  one call (the registry's own refusal would come only at the first call with a dropped row, perhaps many steps
  in);
- ``policy_loss.fipo_allow_split_step=true``: the explicit opt-in to the approximation: this call's drop (FIPO's
  row selector) with verl's count as given, so the dropped rows of the step stay in its denominator
  (``tests/integration/test_verl_fipo.py`` measures it; docs/algorithms/fipo.md). The metric
  ``fipo/split_step_approximate`` reads 1 on every such call (0 on exact calls).

The stalerl runtime, TRL, ms-swift, AReaL and Trinity-RFT split a step through
``recipe.optimizer_batch.plan_optimizer_batch``, which hands each micro-batch the step's drop and kept-token count.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.common import cfg_lookup, global_batch_info
from recipe.declaration import param
from recipe.registry import get_declaration, get_policy_loss_fn, get_policy_loss_spec
from recipe.verl.metrics import verl_metrics

KEY_PREFIX = "actor_rollout_ref.actor"


def allow_split_param(loss: str) -> Any:
    """The opt-in key of a row-selector loss in verl (``<loss>_allow_split_step``): a verl-adapter key, not a loss
    parameter (the registry's loss has no split to allow)."""
    return param(f"{loss}_allow_split_step", False,
                 help=f"verl: accept a split optimizer step for {loss} (several micro-batches or GPUs); the dropped "
                      f"rows then stay in the step's denominator (logged as {loss}/split_step_approximate).")


def approximate_metric(loss: str) -> str:
    """Logged on every call of a row-selector loss in verl: 1 when the opt-in approximation ran, 0 when exact."""
    return f"{loss}/split_step_approximate"


def needs_whole_step(declaration: Any) -> bool:
    """Whether verl must run loss ``declaration`` behind the whole-step check: its step decides per row
    (``step="row_selector"``: a dropped row leaves the whole step's denominator, which one verl call cannot see)."""
    return declaration.step == "row_selector"


#: FIPO's (the names the packaged config and the docs use).
ALLOW_SPLIT = allow_split_param("fipo")
ALLOW_SPLIT_KEY = ALLOW_SPLIT.name
APPROXIMATE_METRIC = approximate_metric("fipo")


def split_step_message(batch_num_tokens: Any, own_tokens: int, dp_size: int, loss: str = "fipo") -> str:
    return (f"{loss} in verl: this optimizer step is split (verl's batch_num_tokens={batch_num_tokens}, this loss "
            f"call holds {own_tokens} valid tokens, dp_size={dp_size}), and verl's loss sees one micro-batch, so the "
            f"rows {loss} drops in the other calls would stay in the step's "
            f"denominator (not the {loss} objective). Fix: one "
            f"call per step: {KEY_PREFIX}.ppo_micro_batch_size_per_gpu = ppo_mini_batch_size x rollout.n, "
            f"{KEY_PREFIX}.use_dynamic_bsz=false, one GPU (trainer.n_gpus_per_node=1 trainer.nnodes=1); or train "
            f"{loss} with the stalerl runtime / TRL (exact at any split); or "
            f"accept the approximation explicitly with {KEY_PREFIX}.policy_loss.{loss}_allow_split_step=true "
            f"(logged as {approximate_metric(loss)})")


_WRAPPERS: dict[str, Any] = {}


def whole_step_loss(loss: str) -> Any:
    """The function verl gets for a row-selector loss (its declaration's ``step``): the registry's loss on a step
    that is one call, a split step refused (or, opted in, this call's drop with verl's count). Made once per loss."""
    fn = _WRAPPERS.get(loss)
    if fn is not None:
        return fn
    allow, metric = allow_split_param(loss), approximate_metric(loss)

    def compute(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, float]]:
        spec = get_policy_loss_spec(loss)
        info = global_batch_info(config)
        dp_size = int(info.get("dp_size") or 1)
        batch_num_tokens = info.get("batch_num_tokens")
        if isinstance(batch_num_tokens, torch.Tensor):
            batch_num_tokens = int(batch_num_tokens.item())
        own_tokens = int(response_mask.bool().sum())
        args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        if dp_size == 1 and (batch_num_tokens is None or int(batch_num_tokens) == own_tokens):
            value, metrics = spec.fn(*args)  # the call is the step: the registry's loss is the reference with it
            return value, {**metrics, metric: 0.0}
        allowed, path = cfg_lookup(config, (f"policy_loss.{allow.name}", allow.name), False)
        if not allow.check(allowed, f"{KEY_PREFIX}.{path}"):
            raise ValueError(split_step_message(batch_num_tokens, own_tokens, dp_size, loss))
        # opted in: this call's drop, verl's count as given (the step's dropped rows stay in its denominator)
        keep = spec.row_selector(old_log_prob, log_prob, advantages, response_mask, config=config)["row_keep_mask"]
        value, metrics = spec.fn(*args, row_keep_mask=keep)
        return value, {**metrics, metric: 1.0}

    compute.__name__ = compute.__qualname__ = f"compute_policy_loss_{loss}_whole_step"
    compute.__doc__ = (f"``{loss}`` behind verl's whole-step check: the registry's loss on a step that is one call, "
                       "else refused (module doc).")
    _WRAPPERS[loss] = compute
    return compute


_VERL_FUNCTIONS: dict[str, Any] = {}


def verl_loss(loss: str) -> Any:
    """The function verl's registry holds for registry loss ``loss``: the registry's loss (behind the whole-step
    check for a loss whose step decides per row, :func:`whole_step_loss`), its metrics under the names that say what
    verl's plain mean makes of a declared SUM or MAX rule (:mod:`recipe.verl.metrics`). Made once per loss."""
    fn = _VERL_FUNCTIONS.get(loss)
    if fn is not None:
        return fn
    declaration = get_declaration(loss)

    def compute(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, float]]:
        decl = get_declaration(loss)  # looked up per call: the registry's current loss, as verl's own lookup would
        inner = whole_step_loss(loss) if needs_whole_step(decl) else get_policy_loss_fn(loss)
        value, metrics = inner(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                               response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                               rollout_is_weights=rollout_is_weights)
        return value, verl_metrics(metrics, decl.metrics)

    compute.__name__ = compute.__qualname__ = f"compute_policy_loss_{loss}_verl"
    compute.__doc__ = (f"``{loss}`` in verl's registry: ``recipe.registry``'s loss, its SUM/MAX metrics renamed for "
                       "verl's mean (recipe.verl.metrics)" + (", behind the whole-step check (module doc)."
                                                               if needs_whole_step(declaration) else "."))
    _VERL_FUNCTIONS[loss] = compute
    return compute


#: FIPO's, by the name the tests and docs use: the function verl's registry holds for ``fipo``.
compute_policy_loss_fipo_verl = verl_loss("fipo")


__all__ = ["ALLOW_SPLIT", "ALLOW_SPLIT_KEY", "APPROXIMATE_METRIC", "allow_split_param", "approximate_metric",
           "compute_policy_loss_fipo_verl", "needs_whole_step", "split_step_message", "verl_loss", "whole_step_loss"]
