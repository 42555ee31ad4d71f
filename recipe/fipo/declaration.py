"""FIPO's declaration (torch-free): its five keys, the PPO clip it uses, a row selector, its metric rules.

The arithmetic is in recipe/fipo/algorithm.py; this is everything else about the loss (recipe/declaration.py)."""

from typing import Any, Mapping

from recipe.declaration import LossDeclaration, NamesakeFlag, mean_over, param, SUM


def _rules(values: Mapping[str, Any], clip: tuple[float, float]) -> list[tuple[str, str]]:
    """FIPO's cross-key rules (the PPO clip is the framework's: ``clip = (eps_low, eps_high)``)."""
    out = []
    eps_high = clip[1]
    if values["fipo_clip_ratio_c"] <= 1.0 + eps_high:
        out.append(("fipo_clip_ratio_c",
                    f"must be > 1 + eps_high = {1.0 + eps_high} (FIPO's sequence drop and Future-KL filter assume the "
                    f"dual clip sits above the PPO clip), got {values['fipo_clip_ratio_c']}. Fix: set it to 10."))
    if not values["fipo_influence_clip_high_only"] and values["fipo_influence_clip_ratio"] >= 1.0:
        out.append(("fipo_influence_clip_ratio",
                    "must be < 1 in symmetric mode (fipo_influence_clip_high_only=false: the lower bound 1 - eps_f "
                    f"must stay positive), got {values['fipo_influence_clip_ratio']}. Fix: set it to 0.2."))
    return out


DECLARATION = LossDeclaration(
    name="fipo",
    summary="FIPO (arXiv 2603.19835): dual-clip PPO on the advantage reweighted by the clipped discounted Future-KL; "
            "an A<0 row with more than one token of ratio > c is dropped.",
    params=(
        param("fipo_decay_rate", 32.0, gt=0.0,
              help="FIPO: half-life in tokens of the Future-KL discount, gamma = 2^(-1/decay_rate)."),
        param("fipo_clip_ratio_c", 10.0, gt=1.0,
              help="FIPO: dual-clip constant c; tokens with ratio > c leave the Future-KL sums, and an A < 0 row with "
                   "more than one of them is dropped. Must exceed 1 + the upper PPO clip range."),
        param("fipo_influence_clip_ratio", 0.2, ge=0.0,
              help="FIPO: eps_f, the influence-weight clip; 0 = weights capped at 10 only."),
        param("fipo_influence_clip_high_only", True,
              help="FIPO: clip weights to [1, 1+eps_f] (true) or [1-eps_f, 1+eps_f] (false)."),
        param("fipo_safety_threshold", 10.0, gt=0.0,
              help="FIPO: for A < 0 tokens with ratio above this, the weight is clamped into [0.8, 1]; >= 5e8 never "
                   "fires."),
    ),
    step="row_selector",
    uses_ppo_clip=True,
    rules=(_rules,),
    framework_names={"swift": "fipo_ref"},  # ms-swift ships a "fipo" of its own
    # ms-swift's flags of its own fipo (4.6 defaults): with fipo_ref a changed one would be ignored, so it is refused
    namesake_flags={"swift": (NamesakeFlag("fipo_decay_rate", 32.0, "fipo_decay_rate"),
                              NamesakeFlag("fipo_clip_range", 0.2, "fipo_influence_clip_ratio"),
                              NamesakeFlag("fipo_clip_high_only", True, "fipo_influence_clip_high_only"),
                              NamesakeFlag("fipo_safety_threshold", 4.0, "fipo_safety_threshold"),
                              NamesakeFlag("delta", None, "fipo_clip_ratio_c"))},
    without_drift="every ratio is 1 (up to engine noise), every influence weight is 1 and FIPO is the plain clipped "
                  "PG loss",
    metrics={
        # fractions of the valid tokens, of the tokens that enter the loss (kept rows), and of the rows
        "fipo/influence_weights_mean_raw": mean_over("valid_tokens"),
        "fipo/influence_weight_clip_ratio_upper": mean_over("valid_tokens"),
        "fipo/influence_weight_clip_ratio_lower": mean_over("valid_tokens"),
        "fipo/sequence_drop_ratio": mean_over("rows"),
        "fipo/clip_fraction": mean_over("fipo/num_kept_tokens"),
        "fipo/dual_clip_fraction": mean_over("fipo/num_kept_tokens"),
        "fipo/num_kept_tokens": SUM,
    },
)
