"""recipe/trinity stays an adapter: it imports only the standard library, torch, ``recipe`` and Trinity-RFT (never the
stalerl runtime), and without Trinity it fails on import with one line saying what to install."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ADAPTER = REPO / "recipe" / "trinity"
ALLOWED = {"torch", "recipe", "trinity"}


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_adapter_imports_only_stdlib_torch_recipe_and_trinity() -> None:
    files = sorted(ADAPTER.rglob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "losses.py"}
    for path in files:
        foreign = {name for name in _top_level_imports(path)
                   if name not in ALLOWED and name not in sys.stdlib_module_names and name != "__future__"}
        assert not foreign, f"{path.relative_to(REPO)} imports {sorted(foreign)}; adapters import only torch, recipe " \
                            "and their framework"


@pytest.mark.skipif(importlib.util.find_spec("trinity") is not None, reason="Trinity-RFT is installed here")
def test_import_without_trinity_names_the_extra() -> None:
    sys.modules.pop("recipe.trinity", None)
    with pytest.raises(ImportError, match=r'pip install "stalerl\[trinity\]"'):
        importlib.import_module("recipe.trinity")
    assert "recipe.trinity" not in sys.modules
