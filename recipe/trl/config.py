"""``GRPOConfig``: TRL's GRPOConfig plus one field per parameter of every registered loss (generated).

The fields come from the losses' declarations (``recipe.registry.declarations()``: the built-ins and the
``recipe.losses`` plugins): name ``Param.name_in("trl")``, default ``Param.default_in("trl")``, help (with the bounds)
from the Param. Validation is the Param's own check and the declaration's rules (:func:`validate_grpo_args`).
"""

from __future__ import annotations

import dataclasses
import inspect

import trl

from recipe.trl.losses import FRAMEWORK, check_no_shadowing, config_params, trl_loss_types_from_source, \
    validate_grpo_args
from recipe.versions import check_framework_version

check_framework_version("trl", where="recipe.trl")
# TRL's own loss names, read from the installed TRL: if it gained one of ours, ours would silently take it over.
TRL_SOURCES = (inspect.getsource(inspect.getmodule(trl.GRPOTrainer)), inspect.getsource(inspect.getmodule(trl.GRPOConfig)))
check_no_shadowing(trl_loss_types_from_source(*TRL_SOURCES), trl.__version__)


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
