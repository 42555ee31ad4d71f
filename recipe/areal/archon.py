"""AReaL's (experimental) Archon PPO actor engine with :class:`recipe.areal.actor.ExactLossPPOActor` as its actor
(GPU only; importable by path for AReaL's remote workers, like :mod:`recipe.areal.fsdp`)."""

from __future__ import annotations

from typing import Any

from areal.experimental.engine.archon_engine import ArchonPPOActor

from recipe.areal.actor import ExactLossPPOActor


class ExactLossArchonPPOActor(ArchonPPOActor):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.actor = ExactLossPPOActor(config, self)
