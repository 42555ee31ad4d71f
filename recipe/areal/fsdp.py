"""AReaL's FSDP PPO actor engine with :class:`recipe.areal.actor.ExactLossPPOActor` as its actor.

A module-level class, so AReaL's single-controller mode, which creates engines in remote worker processes from
``f"{cls.__module__}.{cls.__name__}"``, imports this very class there (``recipe.areal.fsdp.ExactLossFSDPPPOActor``).
"""

from __future__ import annotations

from typing import Any

from areal.engine.fsdp_engine import FSDPPPOActor

from recipe.areal.actor import ExactLossPPOActor


class ExactLossFSDPPPOActor(FSDPPPOActor):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.actor = ExactLossPPOActor(config, self)
