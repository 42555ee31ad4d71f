"""Stale-rollout policy losses behind verl's policy-loss signature, and their framework integrations.

- ``recipe/<loss>/``: one loss each, ``algorithm.py`` importing only torch; ``import recipe.m2po`` registers ``m2po``,
  ``recipe.baselines`` ``vanilla`` (PPO clip) and ``no_trust_region``, ``recipe.fipo`` ``fipo``.
- ``recipe/<framework>/``: one training framework's integration (``recipe/verl/``: the verl plugin, config classes
  and packaged Hydra configs). It imports only torch, ``recipe`` and its framework (lazily, with an error naming the
  extra to install), never the ``stalerl`` runtime.
- Shared by both: ``recipe.registry`` (the losses by name), ``recipe.common`` (helpers of the losses) and
  ``recipe.optimizer_batch`` (one selection and token count per optimizer step across micro-batches).
"""

from recipe.registry import (  # noqa: F401
    get_batch_selector,
    get_policy_loss_fn,
    get_policy_loss_spec,
    register_policy_loss,
    registered_policy_losses,
)
