"""The names a loss's metrics are logged under in verl: a declared rule verl cannot honour is said in the name.

verl's ``ppo_loss`` wraps every policy-loss metric as a ``Metric(aggregation=MEAN)`` and its engine takes the plain
mean of the loss calls' values over the optimizer step's micro-batches and data-parallel ranks (a loss cannot ask
for another aggregation: verl's ``Metric.from_dict`` refuses one). A loss call cannot undo that itself: it knows
the step's token count (``global_batch_info``), but not how many calls the step has. So the adapter renames:

=========================== ================================================ ==========================================
declared rule               what verl logs                                   name in verl (``actor/`` + ...)
=========================== ================================================ ==========================================
``SUM`` (counts)            the mean of the calls' counts: the step's        ``<key>/mean_per_call``
                            total / (micro-batches x ranks)
``MAX`` (maxima)            the mean of the calls' maxima (<= the step's)    ``<key>/mean_of_call_max``
``MEAN`` (weighted)         the unweighted mean of the calls' values: exact  ``<key>`` (unchanged)
                            when every call has the same weight (one call
                            per step; equal micro-batches)
=========================== ================================================ ==========================================

The rule of a key is its declaration's (``LossDeclaration.metrics``), else the naming convention of
``recipe.declaration.rule_for`` (``num_*`` a sum, ``*_max`` a max). The renaming happens on every call, also on a step
that is one call (where verl's mean is exact for every rule): a loss call cannot tell whether it is the step's only
one, so one name always means one thing. Multiply ``<key>/mean_per_call`` by the calls per step to get the count.

Torch-free (the names are needed where configs and docs are checked).
"""

from __future__ import annotations

from typing import Mapping

from recipe.declaration import Metric, rule_for

#: Declared rule -> the suffix of the name verl logs such a metric under (a rule not here keeps its name).
SUFFIXES = {"sum": "mean_per_call", "max": "mean_of_call_max"}


def verl_metric_name(key: str, rules: Mapping[str, Metric]) -> str:
    """The name verl logs metric ``key`` of a loss under (without verl's ``actor/`` prefix), given the loss's
    declared ``rules``: ``<key>/<suffix>`` for a rule verl cannot honour (:data:`SUFFIXES`), else ``key``."""
    suffix = SUFFIXES.get(rule_for(key, rules).combine)
    return key if suffix is None else f"{key}/{suffix}"


def verl_metrics(metrics: Mapping[str, float], rules: Mapping[str, Metric]) -> dict[str, float]:
    """One loss call's ``metrics`` under the names verl logs them (:func:`verl_metric_name`), values unchanged."""
    return {verl_metric_name(key, rules): value for key, value in metrics.items()}


__all__ = ["SUFFIXES", "verl_metric_name", "verl_metrics"]
