"""AReaL adapter: the exact ``recipe.registry`` losses (M2PO's Algorithm 1, FIPO, ...) inside AReaL's own PPO actor.

Opt in by importing the trainer and config from here instead of AReaL in the training script::

    from recipe.areal import GRPOConfig, PPOTrainer   # instead of areal's PPOTrainer and GRPOConfig

and set ``actor.loss: m2po`` (tau: ``actor.m2_threshold``, default 0.04) or ``actor.loss: fipo`` (``actor.fipo_*``)
in the AReaL yaml. Unset, everything is AReaL's own. See ``docs/integrations/areal.md``.

Modules: :mod:`~recipe.areal.packed` and :mod:`~recipe.areal.rules` need only torch and ``recipe``; the others import
AReaL (the tested range is ``recipe.versions``; checked when the config or actor is built), so this package
imports them lazily: ``import recipe.areal`` costs nothing without AReaL.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_LAZY = {
    "GRPOConfig": "recipe.areal.config",
    "PPOConfig": "recipe.areal.config",
    "ExactLossPPOActorConfig": "recipe.areal.config",
    "PPOTrainer": "recipe.areal.trainer",
    "ExactLossPPOActor": "recipe.areal.actor",
    "ExactLossFSDPPPOActor": "recipe.areal.fsdp",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'recipe.areal' has no attribute {name!r}")
    if importlib.util.find_spec("areal") is None:
        from recipe.versions import FRAMEWORKS

        raise ImportError(f"recipe.areal.{name} needs AReaL: pip install \"areal{FRAMEWORKS['areal'].tested}\" (GPU), "
                          "or the CPU route in docs/integrations/areal.md (scripts/ci_areal.sh)")
    return getattr(importlib.import_module(module), name)
