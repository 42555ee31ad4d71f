"""``M2POPolicyLossConfig`` and ``FIPOPolicyLossConfig``: verl's ``PolicyLossConfig`` plus the M2PO (FIPO) keys,
validated at config time.

Select it in a verl config with::

    actor_rollout_ref.actor.policy_loss._target_=recipe.verl.config.M2POPolicyLossConfig

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

FIPO (``_target_: recipe.verl.config.FIPOPolicyLossConfig``, ``loss_mode: fipo``; packaged as
``fipo_trainer.yaml``): ``fipo_decay_rate`` (> 0, default 32), ``fipo_clip_ratio_c`` (> 1, default 10),
``fipo_influence_clip_ratio`` (>= 0, default 0.2), ``fipo_influence_clip_high_only`` (bool, default true),
``fipo_safety_threshold`` (> 0, default 10); see recipe/fipo/algorithm.py. The PPO clip is the actor's
``clip_ratio_low`` / ``clip_ratio_high``; the rule ``fipo_clip_ratio_c > 1 + clip_ratio_high`` spans the actor and
its policy_loss, so it is checked by the loss on its first call (a ValueError naming both keys).
``fipo_allow_split_step`` (bool, default false): accept verl's split optimizer step for FIPO, where dropped rows stay
in the denominator (an approximation, logged as ``fipo/split_step_approximate``); by default a split step is refused
at the first loss call (recipe/verl/losses.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

from recipe.fipo.algorithm import FIPOParams
from recipe.m2po.algorithm import DEFAULT_M2_THRESHOLD, SCOPES
from recipe.verl.plugin import register as _register

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


def _number(name: str, value, *, minimum: float, inclusive: bool) -> float:
    relation = ">=" if inclusive else ">"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (value < minimum if inclusive else value <= minimum):
        raise ValueError(f"{KEY_PREFIX}.{name} must be a finite number {relation} {minimum}, got {value!r} "
                         f"({type(value).__name__})")
    return float(value)


_FIPO_DEFAULTS = FIPOParams()


@dataclass
class FIPOPolicyLossConfig(PolicyLossConfig):
    """verl ``PolicyLossConfig`` with the FIPO keys (see the module docstring and recipe/fipo/algorithm.py)."""

    loss_mode: str = "fipo"
    fipo_decay_rate: float = _FIPO_DEFAULTS.decay_rate
    fipo_clip_ratio_c: float = _FIPO_DEFAULTS.clip_ratio_c
    fipo_influence_clip_ratio: float = _FIPO_DEFAULTS.influence_clip_ratio
    fipo_influence_clip_high_only: bool = _FIPO_DEFAULTS.influence_clip_high_only
    fipo_safety_threshold: float = _FIPO_DEFAULTS.safety_threshold
    fipo_allow_split_step: bool = False

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        for name, minimum, inclusive in (("fipo_decay_rate", 0.0, False), ("fipo_clip_ratio_c", 1.0, False),
                                         ("fipo_influence_clip_ratio", 0.0, True),
                                         ("fipo_safety_threshold", 0.0, False)):
            # BaseConfig freezes fields after __init__; normalise ints to float in place.
            object.__setattr__(self, name, _number(name, getattr(self, name), minimum=minimum, inclusive=inclusive))
        if not isinstance(self.fipo_influence_clip_high_only, bool):
            raise ValueError(f"{KEY_PREFIX}.fipo_influence_clip_high_only must be true or false, got "
                             f"{self.fipo_influence_clip_high_only!r}")
        if not isinstance(self.fipo_allow_split_step, bool):
            raise ValueError(f"{KEY_PREFIX}.fipo_allow_split_step must be true or false, got "
                             f"{self.fipo_allow_split_step!r}")
        if not self.fipo_influence_clip_high_only and self.fipo_influence_clip_ratio >= 1.0:
            raise ValueError(f"{KEY_PREFIX}.fipo_influence_clip_ratio must be < 1 when "
                             f"fipo_influence_clip_high_only is false, got {self.fipo_influence_clip_ratio}")
        if not isinstance(self.loss_mode, str) or not self.loss_mode:
            raise ValueError(f"{KEY_PREFIX}.loss_mode must be a non-empty string, got {self.loss_mode!r}")


__all__ = ["FIPOPolicyLossConfig", "M2POPolicyLossConfig"]
