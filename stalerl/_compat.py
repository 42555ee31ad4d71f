"""Old module paths that something outside this source tree may still import, mapped to their new homes.

Console scripts are small wrapper files written at install time (``from stalerl.report import main``); an environment
installed before the runtime was grouped into subpackages keeps its old wrappers until it is reinstalled. The finder
below makes exactly those old names import the new module (the same module object), with a DeprecationWarning.
Internal code never uses them (``tests/unit/test_import_graph.py`` checks), so no pile of shim files is needed.
``stalerl.cli`` is a real module instead, because ``python -m`` runs a file.
"""
# restructure: keep-old-paths (a compat module: /work/wt-tools/restructure.py neither moves nor rewrites it)

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

#: old name -> new name: the targets of the console scripts in pyproject.toml before the move.
MOVED_MODULES = {
    "stalerl.plot": "stalerl.results.plot",
    "stalerl.report": "stalerl.results.report",
    "stalerl.study": "stalerl.launch.study",
}


class MovedModuleFinder:
    """Resolves an old name in :data:`MOVED_MODULES` to the module at its new name; appended to ``sys.meta_path``,
    so it is asked only after no file was found under the old name. A meta-path finder and loader by protocol
    (``find_spec``, ``create_module``, ``exec_module``): subclassing ``importlib.abc`` would import
    ``importlib.resources`` on every ``import stalerl`` (~10 ms), which the fast ``--help`` does not need."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; reinstall stalerl (pip install -e .) to refresh console scripts "
                      f"that still import the old name", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)  # the import system then files this same object under the old name

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its new name


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
