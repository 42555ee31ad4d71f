"""Old path of the verl plugin (the ``verl.plugins`` entry point of installs made before the move): importing it
imports :mod:`recipe.verl.plugin`, which registers the losses in verl's registry."""
# restructure: keep-old-paths (a compat module: /work/wt-tools/restructure.py neither moves nor rewrites it)

from recipe.verl.plugin import REGISTERED, SUPPORTED_VERL, register  # noqa: F401
