"""The M2PO authors' released variant (adaptive clip bound from the M2 budget) as an opt-in registered loss:
``get_policy_loss_fn("m2po_authors")``, threshold key ``m2_threshold`` (default 0.04). ``m2po`` (Algorithm 1) stays
the default; see recipe/m2po_authors/algorithm.py for where the two differ."""

from recipe.m2po_authors.algorithm import (  # noqa: F401
    BOUND_KEYS,
    METRIC_KEYS,
    AuthorsBound,
    AuthorsSelection,
    authors_trust_region,
    compute_policy_loss_m2po_authors,
    m2po_authors_batch_selector,
    solve_bound,
)
from recipe.registry import register_policy_loss

register_policy_loss("m2po_authors", batch_selector=m2po_authors_batch_selector)(compute_policy_loss_m2po_authors)
