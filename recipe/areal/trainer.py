"""``PPOTrainer``: AReaL's trainer that builds the exact-loss actor engine when ``actor.loss`` is set.

AReaL picks the actor engine class from the backend (``fsdp`` / ``megatron`` / ``archon``) inside
``PPOTrainer._create_train_engine``; this subclass picks the matching ``ExactLoss*PPOActor`` instead, for the actor
only (the reference model's config has no ``loss`` and stays AReaL's). In SPMD mode the engine is built here; in
single-controller mode AReaL's controller sends the class's import path to every remote worker, which imports and
builds the same class there, with the config (this package's dataclass, carried by AReaL's serialisation).
"""

from __future__ import annotations

import importlib
from typing import Any

from areal import PPOTrainer as _AReaLPPOTrainer
from areal.utils.environ import is_single_controller

#: backend -> the import path of its exact-loss actor engine (imported on demand: Megatron needs megatron-core).
EXACT_LOSS_ENGINES = {
    "fsdp": "recipe.areal.fsdp.ExactLossFSDPPPOActor",
    "megatron": "recipe.areal.megatron.ExactLossMegatronPPOActor",
    "archon": "recipe.areal.archon.ExactLossArchonPPOActor",
}


def exact_loss_engine_class(backend: str) -> type:
    """The exact-loss actor engine class for an AReaL train backend name."""
    try:
        path = EXACT_LOSS_ENGINES[backend]
    except KeyError:
        raise ValueError(f"actor.backend {backend!r} has no exact-loss actor engine; expected one of "
                         f"{', '.join(EXACT_LOSS_ENGINES)} (e.g. actor.backend=fsdp:d1p1t1)") from None
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class PPOTrainer(_AReaLPPOTrainer):
    """AReaL's ``PPOTrainer``; with ``actor.loss`` set, the actor engine computes that loss exactly."""

    def _create_train_engine(self, actor_config: Any, alloc: Any) -> Any:
        if getattr(actor_config, "loss", None) is None:
            return super()._create_train_engine(actor_config, alloc)
        actor_cls = exact_loss_engine_class(alloc.backend)
        if is_single_controller():
            actor = actor_cls.as_controller(actor_config, self.scheduler)
        else:
            actor = actor_cls(config=actor_config)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor
