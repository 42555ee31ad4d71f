"""The verl plugin: puts every stalerl loss into verl's ``POLICY_LOSS_REGISTRY``.

Declared in pyproject.toml as the entry point ``stalerl`` of group ``verl.plugins``; verl (>=0.9) imports it from
``verl/__init__.py``, i.e. in every process that imports verl (driver, TaskRunner, Ray workers). Every loss of
``recipe.registry.declarations()`` registers -- the built-ins and the losses of the ``recipe.losses`` entry points
(plugins) -- under its verl name (``declaration.name_in("verl")``). verl gets one function per loss,
:func:`recipe.verl.losses.verl_loss`: the registry's loss as is (verl calls it per micro-batch with its
``ActorConfig`` as ``config``), its metrics renamed as below; a loss whose step decides per row (FIPO) runs behind
verl's whole-step check (:func:`recipe.verl.losses.whole_step_loss`: its drop cannot be exact across verl's
micro-batches; see that module).

Metrics: the keys a loss returns (``m2po/*``, ``fipo/*``, a plugin's ``<loss>/*``) reach the trainer's logs as
``actor/<key>`` (verl's trainer prefixes every actor metric with ``actor/``). verl reduces them itself, once per
optimizer step (mini-batch), and cannot be told a rule: its ``ppo_loss`` wraps every policy-loss metric as
``Metric(aggregation=MEAN)`` (a loss that returns a ``Metric`` of another aggregation is refused by verl's
``Metric.from_dict``), and the engine takes the plain mean over the step's micro-batches and data-parallel ranks
(the trainer then logs the mean over the optimizer steps of one training step). So a key whose declared rule verl
cannot honour is logged under a name that says what verl makes of it (:mod:`recipe.verl.metrics`):

- ``SUM`` (``m2po/num_*_tokens``, ``fipo/num_kept_tokens``, a plugin's counts) as ``<key>/mean_per_call``: the
  step's total divided by the number of micro-batches x ranks;
- ``MAX`` (``no_trust_region/ratio_max``) as ``<key>/mean_of_call_max``: the mean of the calls' maxima (at most the
  step's max);
- ``MEAN`` (weighted by valid tokens, rows or a count metric) keeps its name: verl's unweighted mean of the calls'
  values is exact when every call has the same weight (one call per step: what FIPO needs in verl anyway),
  otherwise an approximation.

Renamed on every call, also when the step is one call (exact for every rule then): a loss call cannot tell whether
it is its step's only one. The stalerl runtime, TRL, ms-swift, AReaL and Trinity-RFT reduce by the declared rules
under the plain names; in verl, compare the renamed counts and maxima across runs only at the same micro-batch split
(or with one call per step).

The installed verl's version is checked against the tested range (``recipe.versions``) before anything registers:
outside it the plugin refuses, unless ``STALERL_ALLOW_UNTESTED_FRAMEWORKS`` lets it through (then it warns).

A plugin loss that cannot join (its ``recipe.losses`` module fails to import, it clashes with another loss, or its
verl name is one of verl's own: ``cispo``, ``gspo``, ...) is refused alone, logged at ERROR in one line naming it and
the fix (``LossDeclaration(framework_names={'verl': ...})``); every other loss registers.

verl swallows plugin import errors (it logs them at DEBUG), which would surface much later as a bare
"Unsupported loss mode: m2po". So a failure here is logged at ERROR with its traceback before it is raised, and the
generated config classes (:mod:`recipe.verl.config`, e.g. ``M2POPolicyLossConfig``, the packaged config's
``policy_loss._target_``) register again on import and raise, so a broken install stops the run at config time.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from recipe.verl import loss_function, verl_loss_names

logger = logging.getLogger(__name__)


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _check_verl_version() -> None:
    from recipe.versions import check_framework_version

    check_framework_version("verl", where="recipe.verl")


def register() -> dict[str, Any]:
    """Register every stalerl loss verl can take in verl's registry under its verl name; idempotent.

    A loss whose verl name verl already has (its own ``cispo``, or another plugin's function) is left out alone, with
    one logged line naming it and the fix (``recipe.registry.refusals()``); every other loss registers. Raises
    RuntimeError only if verl does not hand back our function after registering it (an unsupported verl).
    """
    from verl.trainer.ppo import core_algos

    from recipe.versions import FRAMEWORKS

    registered: dict[str, Any] = {}
    for verl_name, name in verl_loss_names().items():
        fn = loss_function(verl_name)
        current = core_algos.POLICY_LOSS_REGISTRY.get(verl_name)
        if current is not None and current is not fn and _qualname(current) != _qualname(fn):
            continue  # verl_loss_names() refused it already (a name verl has)
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
