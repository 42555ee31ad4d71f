"""AReaL's Megatron PPO actor engine with :class:`recipe.areal.actor.ExactLossPPOActor` as its actor (GPU only:
needs megatron-core; importable by path for AReaL's remote workers, like :mod:`recipe.areal.fsdp`)."""

from __future__ import annotations

from typing import Any

from areal.engine.megatron_engine import MegatronPPOActor

from recipe.areal.actor import ExactLossPPOActor


class ExactLossMegatronPPOActor(MegatronPPOActor):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.actor = ExactLossPPOActor(config, self)
