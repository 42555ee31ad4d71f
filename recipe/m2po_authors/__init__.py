"""The M2PO authors' released variant (adaptive clip bound from the M2 budget) as an opt-in registered loss:
``get_policy_loss_fn("m2po_authors")``, threshold key ``m2_threshold`` (default 0.04). ``m2po`` (Algorithm 1) stays
the default; see recipe/m2po_authors/algorithm.py for where the two differ.

Importing the package is torch-free: it holds the loss's declaration (``declaration.py``); the arithmetic
(``algorithm.py``, torch) loads on the first attribute it provides, and registers the loss then.
"""

from recipe.m2po_authors.declaration import DECLARATION  # noqa: F401
from recipe.declaration import lazy_attributes

__getattr__ = lazy_attributes(__name__)

