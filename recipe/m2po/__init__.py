"""M2PO as a registered policy loss: ``get_policy_loss_fn("m2po")``; threshold key ``m2_threshold`` (default 0.04)."""

from recipe.m2po.algorithm import (  # noqa: F401
    DEFAULT_M2_THRESHOLD,
    METRIC_KEYS,
    QUADRANT_METRIC_KEYS,
    QUADRANTS,
    QuadrantWeights,
    SELECTION_METRIC_KEYS,
    M2POSelection,
    compute_policy_loss_m2po,
    m2_threshold_from_config,
    m2po_batch_selector,
    quadrant_weights,
    select_m2po,
    selection_from_mask,
    trust_region_mask,
)
from recipe.registry import register_policy_loss

register_policy_loss("m2po", batch_selector=m2po_batch_selector)(compute_policy_loss_m2po)
