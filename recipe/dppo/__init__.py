"""DPPO (Divergence PPO, arXiv 2602.04879) as two registered policy losses: ``dppo_tv`` (binary total variation)
and ``dppo_kl`` (binary KL); in verl ``stalerl_dppo_tv`` / ``stalerl_dppo_kl``.

Importing the package is torch-free: it holds the losses' declarations (``declaration.py``); the arithmetic
(``algorithm.py``, torch) loads on the first attribute it provides, and registers the losses then.
"""

from recipe.dppo.declaration import DPPO_KL, DPPO_TV  # noqa: F401
from recipe.declaration import lazy_attributes

__getattr__ = lazy_attributes(__name__)
