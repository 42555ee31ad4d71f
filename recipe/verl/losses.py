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
from recipe.registry import get_policy_loss_spec

#: The opt-in (``actor_rollout_ref.actor.policy_loss.fipo_allow_split_step``): a verl-adapter key, not a loss
#: parameter (the registry's FIPO has no split to allow).
ALLOW_SPLIT = param("fipo_allow_split_step", False,
                    help="verl: accept a split optimizer step for FIPO (several micro-batches or GPUs); the dropped "
                         "rows then stay in the step's denominator (logged as fipo/split_step_approximate).")
ALLOW_SPLIT_KEY = ALLOW_SPLIT.name
#: Logged on every call: 1 when the opt-in approximation ran, 0 when the call was the exact step.
APPROXIMATE_METRIC = "fipo/split_step_approximate"
KEY_PREFIX = "actor_rollout_ref.actor"


def split_step_message(batch_num_tokens: Any, own_tokens: int, dp_size: int) -> str:
    return (f"fipo in verl: this optimizer step is split (verl's batch_num_tokens={batch_num_tokens}, this loss call "
            f"holds {own_tokens} valid tokens, dp_size={dp_size}), and verl's loss sees one micro-batch, so the rows "
            "FIPO drops in the other calls would stay in the step's denominator (not the FIPO objective). Fix: one "
            f"call per step: {KEY_PREFIX}.ppo_micro_batch_size_per_gpu = ppo_mini_batch_size x rollout.n, "
            f"{KEY_PREFIX}.use_dynamic_bsz=false, one GPU (trainer.n_gpus_per_node=1 trainer.nnodes=1); or train FIPO "
            f"with the stalerl runtime / TRL (exact at any split); or accept the approximation explicitly with "
            f"{KEY_PREFIX}.policy_loss.{ALLOW_SPLIT_KEY}=true (logged as {APPROXIMATE_METRIC})")


def compute_policy_loss_fipo_verl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``fipo`` in verl's registry: the registry's FIPO on a step that is one call, else refused (module doc)."""
    spec = get_policy_loss_spec("fipo")
    info = global_batch_info(config)
    dp_size = int(info.get("dp_size") or 1)
    batch_num_tokens = info.get("batch_num_tokens")
    if isinstance(batch_num_tokens, torch.Tensor):
        batch_num_tokens = int(batch_num_tokens.item())
    own_tokens = int(response_mask.bool().sum())
    args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    if dp_size == 1 and (batch_num_tokens is None or int(batch_num_tokens) == own_tokens):
        loss, metrics = spec.fn(*args)  # the call is the step: the registry's FIPO is the reference with it
        return loss, {**metrics, APPROXIMATE_METRIC: 0.0}
    allowed, path = cfg_lookup(config, (f"policy_loss.{ALLOW_SPLIT_KEY}", ALLOW_SPLIT_KEY), False)
    if not ALLOW_SPLIT.check(allowed, f"{KEY_PREFIX}.{path}"):
        raise ValueError(split_step_message(batch_num_tokens, own_tokens, dp_size))
    # opted in: this call's drop, verl's count as given (the step's dropped rows stay in its denominator)
    keep = spec.row_selector(old_log_prob, log_prob, advantages, response_mask, config=config)["row_keep_mask"]
    loss, metrics = spec.fn(*args, row_keep_mask=keep)
    return loss, {**metrics, APPROXIMATE_METRIC: 1.0}


__all__ = ["ALLOW_SPLIT", "ALLOW_SPLIT_KEY", "APPROXIMATE_METRIC", "compute_policy_loss_fipo_verl",
           "split_step_message"]
