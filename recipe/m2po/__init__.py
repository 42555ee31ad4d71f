"""M2PO as a registered policy loss: ``get_policy_loss_fn("m2po")``; threshold key ``m2_threshold`` (default 0.04).

Importing the package is torch-free: it holds the loss's declaration (``declaration.py``); the arithmetic
(``algorithm.py``, torch) loads on the first attribute it provides, and registers the loss then.
"""

from recipe.m2po.declaration import DECLARATION  # noqa: F401
from recipe.declaration import lazy_attributes

__getattr__ = lazy_attributes(__name__)

