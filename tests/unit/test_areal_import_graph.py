"""recipe/areal imports only the standard library, torch, ``recipe`` and AReaL (never the stalerl runtime), and its
torch-only modules (packed, rules, the package itself) do not import AReaL at module level. Checked on the source
(AST), every import statement, lazy ones included."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ADAPTER = Path(__file__).resolve().parents[2] / "recipe" / "areal"
ALLOWED = {"torch", "recipe", "areal"}
AREAL_FREE = {"__init__.py", "packed.py", "rules.py"}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, whether the import sits at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name.split(".")[0], id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], id(node) in top_level))
    return out


def test_adapter_imports_only_torch_recipe_and_areal() -> None:
    files = sorted(ADAPTER.glob("*.py"))
    assert {p.name for p in files} >= {"__init__.py", "packed.py", "rules.py", "actor.py", "config.py", "fsdp.py",
                                        "trainer.py"}
    for path in files:
        for module, at_top in _imports(path):
            if module in sys.stdlib_module_names or module == "__future__":
                continue
            assert module in ALLOWED, f"{path.name} imports {module!r}; the adapter may import only {sorted(ALLOWED)}"
            if path.name in AREAL_FREE:
                assert not (module == "areal" and at_top), f"{path.name} must not import areal at module level"


def test_the_check_sees_imports() -> None:
    names = {m for m, _ in _imports(ADAPTER / "actor.py")}
    assert {"torch", "areal", "recipe"} <= names
