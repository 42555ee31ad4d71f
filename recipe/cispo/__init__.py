"""CISPO as a registered policy loss: ``get_policy_loss_fn("cispo")`` (verl, TRL and ms-swift: ``stalerl_cispo``).

Importing the package is torch-free: it holds the loss's declaration (``declaration.py``); the arithmetic
(``algorithm.py``, torch) loads on the first attribute it provides, and registers the loss then.
"""

from recipe.cispo.declaration import DECLARATION  # noqa: F401
from recipe.declaration import lazy_attributes

__getattr__ = lazy_attributes(__name__)
