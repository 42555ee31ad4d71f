"""FIPO as a registered policy loss: ``get_policy_loss_fn("fipo")``; keys ``fipo_*`` (see recipe.fipo.algorithm)."""

from recipe.fipo.algorithm import (  # noqa: F401
    METRIC_KEYS,
    FIPOParams,
    compute_policy_loss_fipo,
    discounted_future_sum,
    fipo_params_from_config,
    fipo_per_token_loss,
    fipo_row_selector,
    fipo_weights,
)
from recipe.registry import register_policy_loss

register_policy_loss("fipo", row_selector=fipo_row_selector)(compute_policy_loss_fipo)
