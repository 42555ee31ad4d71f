"""The M2PO authors' adaptive-clip variant's declaration (torch-free): M2PO's tau and scope, a batch selector."""

from recipe.declaration import MEAN, SUM, LossDeclaration
from recipe.m2po.declaration import DECLARATION as M2PO, QUADRANTS

DECLARATION = LossDeclaration(
    name="m2po_authors",
    summary="The M2PO authors' released variant: the M2 budget tau becomes one adaptive PPO clip bound (opt-in; "
            "m2po is Algorithm 1).",
    params=M2PO.params,  # the same tau and scope, one declaration
    step="batch_selector",
    step_scope=M2PO.step_scope,  # the same scope parameter, read the same way
    metrics={
        "m2po_authors/m2_before": MEAN,
        "m2po_authors/m2_capped": MEAN,
        "m2po_authors/clip_fraction": MEAN,
        "m2po_authors/trust_region_fraction": MEAN,
        "m2po_authors/log_ratio_bound": MEAN,
        "m2po_authors/num_valid_tokens": SUM,
        "m2po_authors/num_trust_region_tokens": SUM,
        "m2po_authors/num_clipped_tokens": SUM,
        "m2po_authors/threshold": MEAN,
        **{f"m2po_authors/num_clipped_{q}": SUM for q in QUADRANTS},
        **{f"m2po_authors/clipped_weight_share_{q}": MEAN for q in QUADRANTS},
    },
    diagnostics=(*(f"m2po_authors/{what}_{q}" for what in ("num_clipped", "clipped_weight_share")
                   for q in QUADRANTS),
                 "m2po_authors/clip_fraction", "m2po_authors/m2_before", "m2po_authors/log_ratio_bound"),
)
