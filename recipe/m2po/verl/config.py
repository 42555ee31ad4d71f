"""``M2POPolicyLossConfig``: verl's ``PolicyLossConfig`` plus the M2PO keys, validated at config time.

Select it in a verl config with::

    actor_rollout_ref.actor.policy_loss._target_=recipe.m2po.verl.config.M2POPolicyLossConfig

(the packaged ``m2po_trainer.yaml`` does). verl instantiates it with Hydra wherever it builds the actor config: in
the driver (``validate_config``) and in each actor worker (``init_model``). Importing this module registers the
stalerl losses in verl's registry (a backstop for the ``verl.plugins`` entry point), and fails loudly if that is
impossible.

Keys (under ``actor_rollout_ref.actor.policy_loss``):

- ``m2_threshold`` (float >= 0, default 0.04): tau, the bound on the second moment of the log-ratio over the
  trust-region tokens.
- ``m2_scope`` (``local`` | ``dp_group``, default ``local``): the tokens one selection sees. verl calls the loss per
  micro-batch per GPU; ``local`` selects over that micro-batch, ``dp_group`` over that micro-batch on every rank of
  the default process group (exact Algorithm 1 over the whole mini-batch when each GPU runs one micro-batch per
  mini-batch). ``dp_group`` needs the default group to be the data-parallel group (FSDP, no Ulysses SP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

from recipe.m2po.algorithm import DEFAULT_M2_THRESHOLD, SCOPES
from recipe.m2po.verl.plugin import register as _register

# Backstop registration: runs in every process that instantiates this config, even with
# VERL_USE_EXTERNAL_PLUGINS=none or a broken entry point; raises (so Hydra fails loudly) if it cannot register.
_register()

KEY_PREFIX = "actor_rollout_ref.actor.policy_loss"


@dataclass
class M2POPolicyLossConfig(PolicyLossConfig):
    """verl ``PolicyLossConfig`` with ``m2_threshold`` and ``m2_scope`` (see the module docstring)."""

    loss_mode: str = "m2po"
    m2_threshold: float = DEFAULT_M2_THRESHOLD
    m2_scope: str = "local"

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        value = self.m2_threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{KEY_PREFIX}.m2_threshold must be a finite number >= 0 (e.g. 0.04), got {value!r} "
                             f"({type(value).__name__})")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{KEY_PREFIX}.m2_threshold must be a finite number >= 0 (e.g. 0.04), got {value!r}")
        # BaseConfig freezes fields after __init__; normalise an int threshold to float in place.
        object.__setattr__(self, "m2_threshold", float(value))
        if self.m2_scope not in SCOPES:
            raise ValueError(f"{KEY_PREFIX}.m2_scope must be one of {', '.join(SCOPES)}, got {self.m2_scope!r}")
        if not isinstance(self.loss_mode, str) or not self.loss_mode:
            raise ValueError(f"{KEY_PREFIX}.loss_mode must be a non-empty string, got {self.loss_mode!r}")


__all__ = ["M2POPolicyLossConfig"]
