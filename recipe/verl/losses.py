"""FIPO as verl calls it: exact on a step that is one loss call, refused on a split step (or an explicit opt-in).

verl's ``ppo_loss`` calls the policy loss once per micro-batch per GPU, with ``config.global_batch_info`` holding the
mini-batch's ``batch_num_tokens``: every valid token over all micro-batches and ranks, counted before the loss.
FIPO's objective (recipe/fipo/algorithm.py) leaves a dropped row out of the numerator *and* the denominator of the
whole optimizer step, and a row's drop is known only to the call that holds it. So inside verl's micro-batch loop:

- **one call per optimizer step** (``dp_size == 1`` and ``batch_num_tokens`` equal to the call's own valid tokens):
  the call holds the whole step, and :func:`compute_policy_loss_fipo_verl` computes the reference exactly (the
  call's kept tokens as the denominator, rows dropped by its own rule);
- **a split step** (several micro-batches, or several data-parallel ranks): refused at the first loss call, before
  the first update, with one line naming the settings that make the step one call. The dropped rows of the step
  would stay in the denominator (``tests/integration/test_verl_fipo.py`` measures the difference on a batch with
  drops, documented in docs/algorithms/fipo.md);
- ``policy_loss.fipo_allow_split_step=true`` is the explicit opt-in to that approximation: verl's count is used as
  given, and the metric ``fipo/split_step_approximate`` reads 1 on every call (0 on exact calls).

The stalerl runtime, TRL, ms-swift, AReaL and Trinity-RFT split a step through
``recipe.optimizer_batch.plan_optimizer_batch``, which hands each micro-batch the step's drop and kept-token count.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.common import cfg_get, cfg_lookup
from recipe.fipo.algorithm import compute_policy_loss_fipo

#: The opt-in key (``actor_rollout_ref.actor.policy_loss.fipo_allow_split_step``).
ALLOW_SPLIT_KEY = "fipo_allow_split_step"
#: Logged on every call: 1 when the opt-in approximation ran, 0 when the call was the exact step.
APPROXIMATE_METRIC = "fipo/split_step_approximate"
KEY_PREFIX = "actor_rollout_ref.actor"


def _config_view(config: Any, global_batch_info: dict[str, Any]) -> dict[str, Any]:
    """A dict view of verl's ActorConfig (the loss reads it like the config) with another ``global_batch_info``."""
    if isinstance(config, dict):
        out = dict(config)
    elif hasattr(config, "__dict__"):
        out = dict(vars(config))
    else:
        out = {k: v for k, v in config.items()}
    out["global_batch_info"] = global_batch_info
    return out


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
    """``fipo`` in verl's registry: the registry's FIPO, exact when the call is the step, else refused (module doc)."""
    info = dict(cfg_get(config, "global_batch_info", None) or {})
    dp_size = int(info.get("dp_size") or 1)
    batch_num_tokens = info.get("batch_num_tokens")
    own_tokens = int(response_mask.bool().sum())
    if isinstance(batch_num_tokens, torch.Tensor):
        batch_num_tokens = int(batch_num_tokens.item())
    whole_step = dp_size == 1 and (batch_num_tokens is None or int(batch_num_tokens) == own_tokens)
    if whole_step:
        # The call is the step: the reference, with this call's kept tokens (and kept rows) as the denominators.
        lsf = info.get("loss_scale_factor")
        view = _config_view(config, {} if lsf is None else {"loss_scale_factor": lsf})
        loss, metrics = compute_policy_loss_fipo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                                 view, rollout_is_weights)
        return loss, {**metrics, APPROXIMATE_METRIC: 0.0}
    allowed, path = cfg_lookup(config, (f"policy_loss.{ALLOW_SPLIT_KEY}", ALLOW_SPLIT_KEY), False)
    if allowed is not True:
        if allowed is not False:
            raise ValueError(f"{KEY_PREFIX}.{path} must be true or false, got {allowed!r}")
        raise ValueError(split_step_message(batch_num_tokens, own_tokens, dp_size))
    loss, metrics = compute_policy_loss_fipo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                             config, rollout_is_weights)
    return loss, {**metrics, APPROXIMATE_METRIC: 1.0}


__all__ = ["ALLOW_SPLIT_KEY", "APPROXIMATE_METRIC", "compute_policy_loss_fipo_verl", "split_step_message"]
