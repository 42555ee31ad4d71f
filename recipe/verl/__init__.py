"""verl adapter of the stalerl policy losses: every loss of ``recipe.registry`` (the built-ins and the plugin losses).

Installed as a verl plugin (entry point group ``verl.plugins``), so ``import verl`` in any process -- the driver,
the TaskRunner, every Ray worker -- registers the losses in verl's ``POLICY_LOSS_REGISTRY`` under their verl names
(``declaration.name_in("verl")``: the registry name, except ``vanilla`` -> ``stalerl_vanilla``, as verl owns
``vanilla``):

=================== ==========================================================
verl ``loss_mode``  function (``recipe.verl.losses.verl_loss(<registry name>)``)
=================== ==========================================================
``m2po``            ``recipe.registry.get_policy_loss_fn("m2po")``
``stalerl_vanilla`` ``get_policy_loss_fn("vanilla")``
``no_trust_region`` ``get_policy_loss_fn("no_trust_region")``
``m2po_authors``    ``get_policy_loss_fn("m2po_authors")``
``fipo``            ``recipe.verl.losses.compute_policy_loss_fipo_verl``: the registry's FIPO on a step that is
                    one call, a split step refused (or opted in); so for every loss whose declaration's
                    ``step`` is ``row_selector`` (``recipe.verl.losses.whole_step_loss``)
a plugin loss       ``get_policy_loss_fn(<its name>)``
=================== ==========================================================

Each returns the registry loss's value as is and its metrics with a SUM-declared count renamed
``<key>/mean_per_call`` and a MAX-declared maximum ``<key>/mean_of_call_max``: what verl's plain mean over the
step's calls makes of them (:mod:`recipe.verl.metrics`).

Modules (verl is imported lazily, only by these):

- :mod:`recipe.verl.plugin` -- registration (the entry point) after the version check; fails loudly.
- :mod:`recipe.verl.losses` -- the function verl gets per loss; FIPO's whole-step check inside verl's micro-batch
  loop.
- :mod:`recipe.verl.metrics` -- the names verl logs a loss's metrics under (torch-free).
- :mod:`recipe.verl.config` -- one ``PolicyLossConfig`` subclass per loss, generated from its declaration
  (:class:`M2POPolicyLossConfig` with ``m2_threshold`` and ``m2_scope``, :class:`FIPOPolicyLossConfig` with the
  ``fipo_*`` keys, ``policy_loss_config_class(name)`` for any other); selected with ``policy_loss._target_``;
  importing it registers the losses too.
- :mod:`recipe.verl.cli` -- ``stalerl-verl-config-path``: the directory of the packaged Hydra config
  ``m2po_trainer.yaml`` (and ``fipo_trainer.yaml``), for ``python -m verl.trainer.main_ppo --config-path
  "$(stalerl-verl-config-path)" --config-name m2po_trainer ...``.

This package itself imports no verl module (nor torch: :data:`VERL_LOSS_NAMES` is computed on first access), so
``stalerl-verl-config-path`` is fast.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL_HINT = ('pip install -e ".[verl]" in a stalerl checkout, or pip install '
                '"dist/stalerl-0.1.0-py3-none-any.whl[verl]" from a built wheel')


def _verl_installed() -> bool:
    try:
        return importlib.util.find_spec("verl") is not None
    except (ImportError, ValueError):
        return False


if not _verl_installed():
    from recipe.versions import FRAMEWORKS

    raise ImportError(
        f"recipe.verl is the verl adapter of M2PO and needs verl{FRAMEWORKS['verl'].tested}, which is not installed. "
        f"Install it with: {INSTALL_HINT}  (the M2PO loss itself, recipe.m2po, needs only torch)",
        name="verl",
    )



def verl_own_loss_names() -> set[str]:
    """verl's own ``loss_mode`` names: its ``POLICY_LOSS_REGISTRY`` less what this adapter put there (a function of
    ``recipe.registry``, or FIPO's verl wrapper)."""
    from verl.trainer.ppo import core_algos

    from recipe.registry import declarations, registered_functions

    ours = {_qualname(fn) for fn in registered_functions().values()} | \
        {f"recipe.verl.losses.compute_policy_loss_{name}_{what}" for name in declarations()
         for what in ("verl", "whole_step")}
    return {name for name, fn in core_algos.POLICY_LOSS_REGISTRY.items() if _qualname(fn) not in ours}


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def verl_loss_names() -> dict[str, str]:
    """verl ``loss_mode`` name -> name in ``recipe.registry``, for every registered loss (plugins included) that verl
    can take: a loss whose verl name is one of verl's own (``cispo``, ``gspo``, ...) is refused alone, with one logged
    line naming it and the fix (``recipe.registry.usable_declarations``, the clash check of every adapter)."""
    from recipe.registry import registered_policy_losses, usable_declarations

    registered_policy_losses()  # every function loaded, so that verl's own names can be told from ours
    return {decl.name_in("verl"): name
            for name, decl in usable_declarations("verl", own_losses=verl_own_loss_names()).items()}


#: ``_target_`` of the policy-loss config, as written in the packaged Hydra config.
POLICY_LOSS_CONFIG_TARGET = "recipe.verl.config.M2POPolicyLossConfig"
#: The same for FIPO (``fipo_trainer.yaml``).
FIPO_POLICY_LOSS_CONFIG_TARGET = "recipe.verl.config.FIPOPolicyLossConfig"


def config_dir() -> Path:
    """Directory holding the packaged Hydra config ``m2po_trainer.yaml`` (pass it to ``--config-path``)."""
    return Path(__file__).resolve().parent / "config"


def loss_function(verl_name: str):
    """The function the plugin puts in verl's registry under ``verl_name`` (one object per loss,
    :func:`recipe.verl.losses.verl_loss`): the registry's loss, its SUM/MAX metrics under names that say what verl's
    mean makes of them (:mod:`recipe.verl.metrics`), behind the whole-step check for a loss whose declaration decides
    per row (``step="row_selector"``, FIPO)."""
    names = verl_loss_names()
    if verl_name not in names:
        raise KeyError(f"{verl_name!r} is no stalerl loss's verl name; they are: {', '.join(names)}")
    from recipe.verl.losses import verl_loss

    return verl_loss(names[verl_name])


def register() -> dict[str, object]:
    """Register the losses in verl's registry (idempotent); returns ``{verl name: function}``."""
    from recipe.verl.plugin import register as _register

    return _register()


def __getattr__(name: str):
    if name == "VERL_LOSS_NAMES":  # on access: the plugin losses import torch
        return verl_loss_names()
    if name.endswith("PolicyLossConfig") or name in ("policy_loss_config_class", "policy_loss_config_target"):
        import importlib

        return getattr(importlib.import_module("recipe.verl.config"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["INSTALL_HINT", "VERL_LOSS_NAMES", "POLICY_LOSS_CONFIG_TARGET", "FIPO_POLICY_LOSS_CONFIG_TARGET",
           "M2POPolicyLossConfig", "FIPOPolicyLossConfig", "config_dir", "loss_function", "policy_loss_config_class",
           "policy_loss_config_target", "register", "verl_loss_names"]
