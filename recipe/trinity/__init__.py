"""Trinity-RFT adapter: the stalerl losses as Trinity policy-loss classes.

In a Trinity config::

    algorithm:
      policy_loss_fn: recipe.trinity.M2POPolicyLossFn     # or recipe.trinity.FIPOPolicyLossFn, ...
      policy_loss_fn_args: {m2_threshold: 0.04}

Every registered loss has its class, ``recipe.trinity.<Name>PolicyLossFn`` (``VanillaPolicyLossFn``, a plugin's
``ThrowawayPolicyLossFn``), whose arguments are the loss's declared parameters.

Trinity's registry imports this module from the dotted path (no plugin folder needed). Needs Trinity-RFT in the
tested range (``recipe.versions``: 0.6.x; another version is refused when a loss is built unless
``STALERL_ALLOW_UNTESTED_FRAMEWORKS=trinity-rft``), in Trinity's own environment; see docs/integrations/trinity.md.
"""

from __future__ import annotations

import importlib.util

from recipe.versions import FRAMEWORKS

TRINITY_REQUIREMENT = f"trinity-rft{FRAMEWORKS['trinity-rft'].tested}"

if importlib.util.find_spec("trinity") is None:
    raise ImportError(
        "recipe.trinity needs Trinity-RFT, which is not installed in this environment; install it with "
        f'pip install "stalerl[trinity]" (or pip install "{TRINITY_REQUIREMENT}") in the environment that runs '
        "Trinity's trainer")

from recipe.trinity.losses import (  # noqa: E402 - after the check, so a missing Trinity says what to install
    FIPOPolicyLossFn,
    M2POPolicyLossFn,
    engine_path_passes_global_counts,
    policy_loss_class,
)

__all__ = ["FIPOPolicyLossFn", "M2POPolicyLossFn", "TRINITY_REQUIREMENT", "engine_path_passes_global_counts",
           "policy_loss_class"]


def __getattr__(name: str):
    """``recipe.trinity.<Name>PolicyLossFn`` for every other registered loss (a plugin's included), made from its
    declaration on first use (``recipe.trinity.losses.policy_loss_class``)."""
    from recipe.trinity import losses

    return getattr(losses, name)
