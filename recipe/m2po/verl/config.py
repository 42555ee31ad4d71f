"""Old ``_target_`` path of the verl policy-loss configs: the classes of :mod:`recipe.verl.config` (same objects)."""
# restructure: keep-old-paths (a compat module: /work/wt-tools/restructure.py neither moves nor rewrites it)

from recipe.verl.config import FIPOPolicyLossConfig, M2POPolicyLossConfig  # noqa: F401
