"""This project's losses (every loss of ``recipe.registry``) inside TRL's ``GRPOTrainer`` (trl >= 1.16, < 1.17).

    from recipe.trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(loss_type="m2po", m2_threshold=0.04, ...)   # or loss_type="fipo", fipo_* fields
    GRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...).train()

Drop-in subclasses of TRL's classes: a ``loss_type`` of ``recipe.registry`` (``STALERL_LOSS_TYPES``: m2po, fipo, the
baselines, plugins) is exact at the optimizer step; every other ``loss_type`` is TRL's own, unchanged.
TRL is imported only when one of these names is first used, so ``import recipe`` never needs it; without TRL the
error names the extra to install. See docs/integrations/trl.md.
"""

from __future__ import annotations

from typing import Any

from recipe.trl.losses import TRL_LOSS_TYPES

__all__ = ["GRPOConfig", "GRPOTrainer", "STALERL_LOSS_TYPES", "TRL_LOSS_TYPES"]

_LAZY = {"GRPOConfig": "recipe.trl.config", "GRPOTrainer": "recipe.trl.trainer"}


def __getattr__(name: str) -> Any:
    if name == "STALERL_LOSS_TYPES":  # the registry's losses, read when asked (plugins included)
        from recipe.trl.losses import stalerl_loss_types

        return stalerl_loss_types()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'recipe.trl' has no attribute {name!r}")
    import importlib

    from recipe.trl.losses import require_trl

    require_trl()
    return getattr(importlib.import_module(module), name)
