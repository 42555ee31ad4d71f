"""Stale-rollout policy losses behind verl's policy-loss signature.

``recipe.registry`` holds them by name; ``import recipe.m2po`` registers ``m2po``; ``recipe.baselines`` registers
``vanilla`` (PPO clip) and ``no_trust_region``. Each ``recipe/<name>/algorithm.py`` imports only torch.
"""

from recipe.registry import (  # noqa: F401
    get_batch_selector,
    get_policy_loss_fn,
    get_policy_loss_spec,
    register_policy_loss,
    registered_policy_losses,
)
