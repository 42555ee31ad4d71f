"""``GRPOConfig``: TRL's GRPOConfig plus one field per parameter of every registered loss (generated).

The fields come from the losses' declarations (``recipe.registry.declarations()``: the built-ins and the
``recipe.losses`` plugins): name ``Param.name_in("trl")``, default ``Param.default_in("trl")``, help (with the bounds)
from the Param. Validation is the Param's own check and the declaration's rules (:func:`validate_grpo_args`).
"""

from __future__ import annotations

import dataclasses

import trl

from recipe.trl import losses
from recipe.trl.losses import FRAMEWORK, config_params, validate_grpo_args
from recipe.versions import check_framework_version

check_framework_version("trl", where="recipe.trl")
# TRL's own fields: a loss parameter named like one is refused in TRL (recipe.registry.usable_declarations), alone.
losses.TRL_OWN_FIELDS = tuple(f.name for f in dataclasses.fields(trl.GRPOConfig))


def _field(p):
    bounds = p.bounds_text()
    text = p.help + (f" ({bounds})" if bounds and bounds not in p.help else "")
    metadata = {"help": text}  # HF's argument parser hands the metadata to argparse: help and choices only
    if p.choices is not None:
        metadata["choices"] = list(p.choices)
    return dataclasses.field(default=p.default_in(FRAMEWORK), metadata=metadata)


def _post_init(self) -> None:
    check_framework_version("trl", where="recipe.trl")  # also at import; here a faked version is seen too
    trl.GRPOConfig.__post_init__(self)  # sets steps_per_generation, which the rules read
    validate_grpo_args(self)


GRPOConfig = dataclasses.make_dataclass(
    "GRPOConfig", [(key, p.kind, _field(p)) for key, p in config_params().items()], bases=(trl.GRPOConfig,),
    namespace={"__post_init__": _post_init, "__module__": __name__, "__doc__": (
        "TRL's GRPOConfig; ``loss_type`` also accepts every loss of ``recipe.registry`` (M2PO, FIPO, the baselines, "
        "plugins), with one field per loss parameter.\n\n    Checked at construction: an unknown ``loss_type``, a "
        "loss parameter out of range or against its loss's rules, and TRL options that do not apply to the loss "
        "each fail with one line naming the field.\n    ")})
GRPOConfig.__qualname__ = "GRPOConfig"
