"""CISPO's declaration (torch-free): no parameters of its own (the ratio clip is the framework's PPO clip), its
framework names, and how its metrics combine. The arithmetic is in recipe/cispo/algorithm.py.

Names: the runtime's ``actor.loss=cispo`` is the name users know from the MiniMax-M1 paper. verl 0.9.1, TRL 1.16 and
ms-swift 4.x each ship a loss of their own called ``cispo``, so there this one is ``stalerl_cispo`` (as verl's
``vanilla`` makes ours ``stalerl_vanilla``): registering it as ``cispo`` would silently replace, or be replaced by,
the framework's. TRL's and ms-swift's own ``cispo`` also cap the ratio at ``epsilon_high`` itself (an absolute bound,
no lower bound), where this one clips to ``[1 - eps_low, 1 + eps_high]`` like verl's (docs/algorithms/cispo.md).
"""

from recipe.declaration import MEAN, LossDeclaration

#: The loss's name in the frameworks that ship a ``cispo`` of their own.
FRAMEWORK_NAME = "stalerl_cispo"

DECLARATION = LossDeclaration(
    name="cispo",
    summary="CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi, token-mean over "
            "the step; every token keeps its gradient (the clipped ratio is only its weight).",
    uses_ppo_clip=True,
    framework_names={"verl": FRAMEWORK_NAME, "trl": FRAMEWORK_NAME, "swift": FRAMEWORK_NAME},
    metrics={
        "cispo/clip_fraction_low": MEAN,  # share of the valid tokens with r < 1 - eps_low (weight raised to it)
        "cispo/clip_fraction_high": MEAN,  # share with r > 1 + eps_high (weight capped)
        "cispo/ppo_kl": MEAN,  # mean of log(pi_behaviour / pi_theta) over the valid tokens
    },
    diagnostics=("cispo/clip_fraction_low", "cispo/clip_fraction_high"),
)
