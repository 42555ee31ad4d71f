"""Baselines for stale-rollout comparisons: ``vanilla`` (PPO clip, optional dual clip) and ``no_trust_region``.

Importing the package is torch-free: it holds the loss's declaration (``declaration.py``); the arithmetic
(``algorithm.py``, torch) loads on the first attribute it provides, and registers the loss then.
"""

from recipe.baselines.declaration import NO_TRUST_REGION, VANILLA  # noqa: F401
from recipe.declaration import lazy_attributes

__getattr__ = lazy_attributes(__name__)

