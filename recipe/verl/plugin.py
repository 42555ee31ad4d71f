"""The verl plugin: puts the stalerl losses into verl's ``POLICY_LOSS_REGISTRY``.

Declared in pyproject.toml as the entry point ``stalerl`` of group ``verl.plugins``; verl (>=0.9) imports it from
``verl/__init__.py``, i.e. in every process that imports verl (driver, TaskRunner, Ray workers). The functions
registered are the very objects held by ``recipe.registry`` (no wrapper): verl calls
``recipe.m2po.algorithm.compute_policy_loss_m2po`` itself, per micro-batch, with its ``ActorConfig`` as ``config``.
The one exception is ``fipo``: verl gets :func:`recipe.verl.losses.compute_policy_loss_fipo_verl`, the registry's
FIPO behind a check that the call is the whole optimizer step (FIPO's drop cannot be exact across verl's
micro-batches; see that module).

Metrics: the recipe's keys (``m2po/*``, ``fipo/*``, FIPO's clip fractions ``fipo/clip_fraction`` and
``fipo/dual_clip_fraction`` included) reach the trainer's logs as ``actor/m2po/...`` and ``actor/fipo/...`` (verl's
trainer prefixes every actor metric with ``actor/``), reduced by verl once per optimizer step (mini-batch): the mean
over its micro-batches and data-parallel ranks.

The installed verl's version is checked against the tested range (``recipe.versions``) before anything registers:
outside it the plugin refuses, unless ``STALERL_ALLOW_UNTESTED_FRAMEWORKS`` lets it through (then it warns).

verl swallows plugin import errors (it logs them at DEBUG), which would surface much later as a bare
"Unsupported loss mode: m2po". So a failure here is logged at ERROR with its traceback before it is raised, and the
config class :class:`recipe.verl.config.M2POPolicyLossConfig` -- the packaged config's ``policy_loss._target_``
-- registers again on import and raises, so a broken install stops the run at config time.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from recipe.verl import VERL_LOSS_NAMES, loss_function

logger = logging.getLogger(__name__)


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _check_verl_version() -> None:
    from recipe.versions import check_framework_version

    check_framework_version("verl", where="recipe.verl")


def register() -> dict[str, Any]:
    """Register every stalerl loss in verl's registry under its verl name; idempotent.

    Raises RuntimeError if a verl name is already taken by a different function (verl's own
    ``register_policy_loss`` would overwrite it silently), or if verl does not hand back our function afterwards.
    """
    from verl.trainer.ppo import core_algos

    from recipe.versions import FRAMEWORKS

    registered: dict[str, Any] = {}
    for verl_name in VERL_LOSS_NAMES:
        fn = loss_function(verl_name)
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
                               f"registration; this verl version is not supported (need verl"
                               f"{FRAMEWORKS['verl'].tested})")
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
