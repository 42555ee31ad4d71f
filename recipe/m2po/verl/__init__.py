"""Old home of the verl adapter, kept so that what names it keeps working: verl configs with
``policy_loss._target_: recipe.m2po.verl.config.M2POPolicyLossConfig``, environments installed before the move
(their ``verl.plugins`` entry point is ``recipe.m2po.verl.plugin``, their ``stalerl-verl-config-path`` script calls
``recipe.m2po.verl.cli``). Everything here is the same object as in :mod:`recipe.verl`, the adapter's home.
"""
# restructure: keep-old-paths (a compat module: /work/wt-tools/restructure.py neither moves nor rewrites it)

from __future__ import annotations

from recipe.verl import (  # noqa: F401 - raises the same clear ImportError as recipe.verl when verl is missing
    FIPO_POLICY_LOSS_CONFIG_TARGET,
    INSTALL_HINT,
    POLICY_LOSS_CONFIG_TARGET,
    VERL_LOSS_NAMES,
    config_dir,
    register,
)


def __getattr__(name: str):
    if name in ("M2POPolicyLossConfig", "FIPOPolicyLossConfig"):
        from recipe.verl import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
