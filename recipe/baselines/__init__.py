"""Baselines for stale-rollout comparisons: ``vanilla`` (PPO clip, optional dual clip) and ``no_trust_region``."""

from recipe.baselines.algorithm import (  # noqa: F401
    compute_policy_loss_no_trust_region,
    compute_policy_loss_vanilla,
)
from recipe.registry import register_policy_loss

register_policy_loss("vanilla")(compute_policy_loss_vanilla)
register_policy_loss("no_trust_region")(compute_policy_loss_no_trust_region)
