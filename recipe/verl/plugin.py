"""The verl plugin: puts the stalerl losses into verl's ``POLICY_LOSS_REGISTRY``.

Declared in pyproject.toml as the entry point ``stalerl`` of group ``verl.plugins``; verl (>=0.9) imports it from
``verl/__init__.py``, i.e. in every process that imports verl (driver, TaskRunner, Ray workers). The functions
registered are the very objects held by ``recipe.registry`` (no wrapper): verl calls
``recipe.m2po.algorithm.compute_policy_loss_m2po`` itself, per micro-batch, with its ``ActorConfig`` as ``config``.
The recipe's metric keys (``m2po/m2_before`` ...) reach the trainer's logs as ``actor/m2po/...``, because verl's
trainer prefixes every actor metric with ``actor/``.

verl swallows plugin import errors (it logs them at DEBUG), which would surface much later as a bare
"Unsupported loss mode: m2po". So a failure here is logged at ERROR with its traceback before it is raised, and the
config class :class:`recipe.verl.config.M2POPolicyLossConfig` -- the packaged config's ``policy_loss._target_``
-- registers again on import and raises, so a broken install stops the run at config time.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from recipe.verl import VERL_LOSS_NAMES

logger = logging.getLogger(__name__)

SUPPORTED_VERL = ">=0.9,<0.11"


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _check_verl_version() -> None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.specifiers import SpecifierSet

        installed = version("verl")
    except PackageNotFoundError:  # verl importable from a source tree: nothing to compare
        return
    except ImportError:
        return
    if installed not in SpecifierSet(SUPPORTED_VERL, prereleases=True):
        logger.warning("stalerl's verl plugin supports verl%s; verl %s is installed. The policy-loss contract may "
                       "have changed; check the actor/m2po/* metrics.", SUPPORTED_VERL, installed)


def register() -> dict[str, Any]:
    """Register every stalerl loss in verl's registry under its verl name; idempotent.

    Raises RuntimeError if a verl name is already taken by a different function (verl's own
    ``register_policy_loss`` would overwrite it silently), or if verl does not hand back our function afterwards.
    """
    from verl.trainer.ppo import core_algos

    from recipe.registry import get_policy_loss_fn

    registered: dict[str, Any] = {}
    for verl_name, recipe_name in VERL_LOSS_NAMES.items():
        fn = get_policy_loss_fn(recipe_name)
        current = core_algos.POLICY_LOSS_REGISTRY.get(verl_name)
        if current is not None and current is not fn and _qualname(current) != _qualname(fn):
            raise RuntimeError(
                f"verl policy loss {verl_name!r} is already registered by {_qualname(current)}; stalerl refuses to "
                f"replace it with {_qualname(fn)}. Uninstall the other plugin or disable it with "
                f"VERL_USE_EXTERNAL_PLUGINS=<comma-separated names to load>."
            )
        core_algos.register_policy_loss(verl_name)(fn)
        if core_algos.get_policy_loss_fn(verl_name) is not fn:
            raise RuntimeError(f"verl's get_policy_loss_fn({verl_name!r}) does not return {_qualname(fn)} after "
                               "registration; this verl version is not supported (need verl" + SUPPORTED_VERL + ")")
        registered[verl_name] = fn
    return registered


try:
    _check_verl_version()
    REGISTERED = register()
except Exception as _exc:  # noqa: BLE001 - log loudly, then re-raise: verl itself only logs this at DEBUG
    logger.error(
        "stalerl verl plugin (recipe.verl.plugin) failed: %s: %s -- the stalerl losses are NOT registered and "
        "verl will report 'Unsupported loss mode: m2po' later. Reproduce with: python -c 'import "
        "recipe.verl.plugin'", type(_exc).__name__, _exc,
        exc_info=True,
    )
    raise
