"""verl adapter for the M2PO policy loss (and the stale-rollout baselines).

Installed as a verl plugin (entry point group ``verl.plugins``), so ``import verl`` in any process -- the driver,
the TaskRunner, every Ray worker -- registers these losses in verl's ``POLICY_LOSS_REGISTRY``:

=================== ==========================================================
verl ``loss_mode``  function (the same object as in ``recipe.registry``)
=================== ==========================================================
``m2po``            ``recipe.m2po.algorithm.compute_policy_loss_m2po``
``stalerl_vanilla`` ``recipe.baselines.algorithm.compute_policy_loss_vanilla``
``no_trust_region`` ``recipe.baselines.algorithm.compute_policy_loss_no_trust_region``
``fipo``            ``recipe.verl.losses.compute_policy_loss_fipo_verl``: the registry's FIPO, exact when the
                    call is the whole optimizer step, refused on a split step (or opt-in)
=================== ==========================================================

Modules (verl is imported lazily, only by these):

- :mod:`recipe.verl.plugin` -- registration (the entry point) after the version check; fails loudly.
- :mod:`recipe.verl.losses` -- FIPO's whole-step check inside verl's micro-batch loop.
- :mod:`recipe.verl.config` -- :class:`M2POPolicyLossConfig`, a ``PolicyLossConfig`` subclass with
  ``m2_threshold`` and ``m2_scope``, and :class:`FIPOPolicyLossConfig` with the ``fipo_*`` keys; selected with
  ``policy_loss._target_``; importing it registers the losses too.
- :mod:`recipe.verl.cli` -- ``stalerl-verl-config-path``: the directory of the packaged Hydra config
  ``m2po_trainer.yaml`` (and ``fipo_trainer.yaml``), for ``python -m verl.trainer.main_ppo --config-path
  "$(stalerl-verl-config-path)" --config-name m2po_trainer ...``.

This package itself imports no verl module, so ``stalerl-verl-config-path`` is fast.
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

#: verl ``loss_mode`` name -> name in ``recipe.registry``. verl already owns ``vanilla``, hence ``stalerl_vanilla``.
VERL_LOSS_NAMES = {
    "m2po": "m2po",
    "stalerl_vanilla": "vanilla",
    "no_trust_region": "no_trust_region",
    "fipo": "fipo",
}

#: ``_target_`` of the policy-loss config, as written in the packaged Hydra config.
POLICY_LOSS_CONFIG_TARGET = "recipe.verl.config.M2POPolicyLossConfig"
#: The same for FIPO (``fipo_trainer.yaml``).
FIPO_POLICY_LOSS_CONFIG_TARGET = "recipe.verl.config.FIPOPolicyLossConfig"


def config_dir() -> Path:
    """Directory holding the packaged Hydra config ``m2po_trainer.yaml`` (pass it to ``--config-path``)."""
    return Path(__file__).resolve().parent / "config"


def loss_function(verl_name: str):
    """The function the plugin puts in verl's registry under ``verl_name``: the registry's own object, except
    ``fipo``, which gets FIPO's whole-step check (recipe/verl/losses.py)."""
    if verl_name == "fipo":
        from recipe.verl.losses import compute_policy_loss_fipo_verl

        return compute_policy_loss_fipo_verl
    from recipe.registry import get_policy_loss_fn

    return get_policy_loss_fn(VERL_LOSS_NAMES[verl_name])


def register() -> dict[str, object]:
    """Register the losses in verl's registry (idempotent); returns ``{verl name: function}``."""
    from recipe.verl.plugin import register as _register

    return _register()


def __getattr__(name: str):
    if name in ("M2POPolicyLossConfig", "FIPOPolicyLossConfig"):
        from recipe.verl import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["INSTALL_HINT", "VERL_LOSS_NAMES", "POLICY_LOSS_CONFIG_TARGET", "FIPO_POLICY_LOSS_CONFIG_TARGET",
           "M2POPolicyLossConfig", "FIPOPolicyLossConfig", "config_dir", "loss_function", "register"]
