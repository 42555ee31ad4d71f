"""AReaL config classes with the exact-loss keys: ``actor.loss`` and every declared loss parameter (``actor.fipo_*``,
``actor.m2_scope``, a plugin loss's own, ...), generated from the loss declarations (``recipe/<loss>/declaration.py``
and the ``recipe.losses`` entry points; :func:`recipe.areal.rules.loss_param_fields`).

They subclass AReaL's own dataclasses, so AReaL's loader (``load_expr_config``) reads an AReaL yaml with the new keys,
refuses unknown ones as usual, and AReaL's RPC serialisation carries the subclass (by import path) to the remote
workers of single-controller mode. With ``actor.loss`` unset everything is AReaL's, including the meaning of
``actor.m2_threshold`` (AReaL's own M2PO variant); with ``actor.loss: m2po`` that key is Algorithm 1's tau (a declared
parameter whose key AReaL already has is AReaL's field, not a second one: see ``loss_param_fields``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from areal.api.cli_args import GRPOConfig as _AReaLGRPOConfig
from areal.api.cli_args import PPOActorConfig
from areal.api.cli_args import PPOConfig as _AReaLPPOConfig

from recipe.areal.rules import check_areal_version, check_exact_loss_config, loss_param_fields, usable_losses


def _post_init(self) -> None:
    check_areal_version()
    PPOActorConfig.__post_init__(self)
    check_exact_loss_config(self)


_PARAM_FIELDS = loss_param_fields(PPOActorConfig)  # first: it tells the clash check AReaL's own field names
_LOSS_FIELD = ("loss", Optional[str], field(
    default=None,
    metadata={"help": "Exact stale-rollout policy loss from recipe.registry that replaces AReaL's grpo_loss_fn (one "
                      "of the choices: the built-ins and the losses of the recipe.losses entry points; each loss's "
                      "keys are the fields below). null = AReaL's own loss, m2_threshold keeping AReaL's meaning.",
              "choices": sorted(usable_losses())}))

#: AReaL's ``PPOActorConfig`` plus ``loss`` and the declared parameters of every loss (names as in stalerl's
#: ``actor.*``, or a declaration's ``Param.names["areal"]``).
ExactLossPPOActorConfig = dataclasses.make_dataclass(
    "ExactLossPPOActorConfig", [_LOSS_FIELD, *_PARAM_FIELDS], bases=(PPOActorConfig,),
    namespace={"__post_init__": _post_init, "__module__": __name__,
               "__doc__": "AReaL's ``PPOActorConfig`` plus the keys of the exact losses (generated from the loss "
                          "declarations)."})


@dataclass
class PPOConfig(_AReaLPPOConfig):
    """AReaL's ``PPOConfig`` whose ``actor`` accepts the exact-loss keys."""

    actor: ExactLossPPOActorConfig = field(default_factory=ExactLossPPOActorConfig)


@dataclass
class GRPOConfig(_AReaLGRPOConfig):
    """AReaL's ``GRPOConfig`` whose ``actor`` accepts the exact-loss keys (what ``gsm8k_rl.py`` loads)."""

    actor: ExactLossPPOActorConfig = field(default_factory=ExactLossPPOActorConfig)
