"""Stale-rollout policy losses behind verl's policy-loss signature, and their framework integrations.

- ``recipe/<loss>/``: one loss each: ``declaration.py`` (torch-free: its parameters, step needs, metric rules, names)
  and ``algorithm.py`` (importing only torch and ``recipe``), which registers the loss when the registry first looks
  it up (``import recipe`` or ``import recipe.m2po`` alone imports no torch and registers nothing: the registry holds
  the declarations, the functions load on first use). The registry finds the packages without a list (every
  ``recipe/<dir>/`` with both files); a loss from another package comes through the ``recipe.losses`` entry points
  (docs/adding-a-loss.md).
- ``recipe/<framework>/``: one training framework's integration (``recipe/verl/``: the verl plugin, config classes
  and packaged Hydra configs). It imports only torch, ``recipe`` and its framework (lazily, with an error naming the
  extra to install), never the ``stalerl`` runtime.
- Shared by both: ``recipe.registry`` (the losses by name, plugin isolation, the clash check of every adapter),
  ``recipe.declaration`` (the declarations, the shared PPO-clip group, the metric rules), ``recipe.common`` (helpers
  of the losses), ``recipe.optimizer_batch`` (one selection and token count per optimizer step across
  micro-batches) and ``recipe.testing`` (split invariance and a scratch registry for tests, plugin authors' too).
"""

from recipe.registry import (  # noqa: F401
    get_batch_selector,
    get_policy_loss_fn,
    get_policy_loss_spec,
    register_policy_loss,
    registered_policy_losses,
)
