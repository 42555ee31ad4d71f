"""The baselines' declarations (torch-free): PPO clip (``vanilla``) and the unclipped objective
(``no_trust_region``). Neither has parameters of its own: the PPO clip is the framework's."""

from recipe.declaration import MAX, MEAN, SUM, TRUST_REGION_QUADRANTS, LossDeclaration

QUADRANTS = TRUST_REGION_QUADRANTS

VANILLA = LossDeclaration(
    name="vanilla",
    summary="PPO's clipped surrogate (optional dual clip), the paper's GRPO baseline.",
    ppo_clip=("eps_clip", "eps_clip_higher", "c_clip"),  # the dual clip too
    framework_names={"verl": "stalerl_vanilla"},  # verl ships its own "vanilla"
    metrics={
        "vanilla/clip_fraction": MEAN,
        "vanilla/dual_clip_fraction": MEAN,
        "vanilla/ppo_kl": MEAN,
        **{f"vanilla/num_clipped_{q}": SUM for q in QUADRANTS},
        **{f"vanilla/clipped_weight_share_{q}": MEAN for q in QUADRANTS},
        "vanilla/trust_region_weight_per_token": MEAN,
        **{f"vanilla/clipped_weight_per_token_{q}": MEAN for q in QUADRANTS},
    },
    diagnostics=("vanilla/clip_fraction",
                 *(f"vanilla/{what}_{q}" for what in ("num_clipped", "clipped_weight_share") for q in QUADRANTS)),
)

NO_TRUST_REGION = LossDeclaration(
    name="no_trust_region",
    summary="The unclipped importance-weighted objective -A r over all valid tokens (the paper's GRPO no TR).",
    metrics={
        "no_trust_region/ratio_mean": MEAN,
        "no_trust_region/ratio_max": MAX,
        "no_trust_region/ppo_kl": MEAN,
    },
)

DECLARATIONS = (VANILLA, NO_TRUST_REGION)
