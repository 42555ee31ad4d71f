"""M2PO's declaration (torch-free): tau and the selection scope, a batch selector, and how its metrics combine.

The arithmetic is in recipe/m2po/algorithm.py; this is everything else about the loss (recipe/declaration.py)."""

from recipe.declaration import MAX, MEAN, SUM, TRUST_REGION_QUADRANTS, LossDeclaration, StepScope, param

QUADRANTS = TRUST_REGION_QUADRANTS
SCOPES = ("local", "dp_group")

DECLARATION = LossDeclaration(
    name="m2po",
    summary="M2PO (arXiv 2510.01161, Algorithm 1): inside the PPO trust-region quadrants, mask the largest squared "
            "log-ratios until their second moment is <= m2_threshold; average -M r A over all valid tokens.",
    params=(
        param("m2_threshold", 0.04, ge=0.0,
              help="M2PO: the largest squared log-ratio tokens are masked until the mean M2 of the rest is below "
                   "this (>= 0; 0 masks every token with a nonzero log-ratio)."),
        param("m2_scope", "dp_group", choices=SCOPES, defaults={"verl": "local"},
              help="M2PO selection scope over each optimizer mini-batch (always all of its micro-batches): "
                   "dp_group = across all data-parallel ranks, exactly Algorithm 1 on the whole mini-batch; "
                   "local = each rank's share separately. (verl's default is local: verl calls the loss per "
                   "micro-batch and its default process group need not be the data-parallel group.)"),
    ),
    step="batch_selector",
    # A call inside a planned step selects over its own tokens only (the plan covered the scope); a call outside one
    # cannot know the data-parallel group, so unset it selects locally too.
    step_scope=StepScope(param="m2_scope", group="dp_group", local="local", planned="local", unplanned="local"),
    metrics={
        "m2po/m2_before": MEAN,
        "m2po/m2_after": MEAN,
        "m2po/masked_fraction": MEAN,
        "m2po/trust_region_fraction": MEAN,
        "m2po/num_valid_tokens": SUM,
        "m2po/num_trust_region_tokens": SUM,
        "m2po/num_masked_tokens": SUM,
        "m2po/threshold": MEAN,
        **{f"m2po/num_masked_{q}": SUM for q in QUADRANTS},
        **{f"m2po/masked_weight_share_{q}": MEAN for q in QUADRANTS},
        "m2po/would_clip_fraction": MEAN,
    },
    diagnostics=("m2po/m2_before", "m2po/m2_after", "m2po/masked_fraction", "m2po/would_clip_fraction",
                 *(f"m2po/{what}_{q}" for what in ("num_masked", "masked_weight_share") for q in QUADRANTS)),
)
