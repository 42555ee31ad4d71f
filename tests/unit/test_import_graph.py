"""The import graph of every ``stalerl``, ``recipe`` and ``stalerl_study`` module: no cycle, and the rooms of the
layout import each other only downwards.

The graph is built from the source (AST), without importing anything. An edge ``A -> B`` is an import in ``A`` of the
project module ``B``. Module-level edges are the statements in the module body, including those nested in ``if``/
``try``/``with`` blocks, class bodies and the ``if TYPE_CHECKING:`` branch (a type-checking import is still a
dependency between the two modules). Lazy edges are imports inside functions (they run on call). ``from P import x``
is an edge to ``P.x`` when that is a module, else to ``P``. Importing ``P.sub`` also runs the package
``P/__init__.py`` first, but that implicit edge to a parent package is not counted (Python resolves it through the
partly initialised package); likewise a package's lazy imports of its own submodules (a facade such as
``recipe.verl.register``) are not counted as edges back into the package.

Both graphs must be acyclic. The rooms (``stalerl.<group>``, see ``stalerl/__init__.py``) may import only the rooms
listed in :data:`ALLOWED`, lazily or not; ``recipe`` never imports ``stalerl``. The study tooling (``stalerl_study``:
``stalerl-study``, ``stalerl-report``, claims, statistics, the pilot) sits above the runtime: it may import
``stalerl``, and neither ``stalerl`` nor ``recipe`` imports it, not even by a module name in a string
(``importlib.import_module``, ``python -m``). The framework adapters (``recipe.verl``, ``recipe.trl``, ...) are to reach
the losses through the registry and the loss declarations, never a loss's ``algorithm`` module (issue 37 item 1).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("stalerl", "recipe", "stalerl_study")
RUNTIME_ROOTS = ("stalerl", "recipe")  # what is installed and run; never imports the study tooling


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> Dict[str, Path]:
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            out[_module_name(path)] = path
    return out


def _imports(body: List[ast.stmt], lazy: bool) -> Iterator[Tuple[ast.stmt, bool]]:
    """(import statement, whether it is lazy) for every import in ``body``; lazy = inside a function."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(node.body, True)
        else:
            for name in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, name, None)
                if isinstance(children, list) and children and isinstance(children[0], (ast.stmt, ast.excepthandler)):
                    yield from _imports(children, lazy)


def _target(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """``name`` or its nearest enclosing project module, None outside the project."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(modules: Dict[str, Path], *, include_lazy: bool) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, lazy in _imports(tree.body, False):
            if lazy and not include_lazy:
                continue
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package of this module
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.append(sub if sub in modules else base)
            for t in targets:
                dep = _target(t, modules)
                if dep is None or dep == mod or (lazy and is_pkg and dep.startswith(mod + ".")):
                    continue  # outside the project, itself, or a package's facade over its own submodules
                graph[mod].add(dep)
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle as ``[a, b, ..., a]``, or None."""
    state: Dict[str, int] = {}  # 1 = on the DFS stack, 2 = done
    stack: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


#: room -> the rooms it may import (besides itself). A room is ``stalerl.<group>`` (``stalerl`` alone for the
#: package and its top-level modules) or ``recipe``. Lower rooms first; this is the layout of ``stalerl/__init__.py``.
ALLOWED = {
    "recipe": set(),
    "stalerl.core": set(),
    "stalerl.config": {"stalerl.core", "recipe"},
    "stalerl.data": {"stalerl.core"},
    "stalerl.rollout": {"stalerl.core", "recipe"},  # recipe.versions: the vLLM version guard
    "stalerl.results": {"stalerl.core", "stalerl.config", "recipe"},  # recipe.registry: the losses' diagnostics
    "stalerl.schedulers": {"stalerl.core", "stalerl.config"},
    "stalerl.training": {"stalerl.core", "stalerl.config", "stalerl.data", "stalerl.rollout", "stalerl.results",
                         "recipe"},
    "stalerl.launch": {"stalerl.core", "stalerl.config", "stalerl.data", "stalerl.rollout", "stalerl.results",
                       "stalerl.schedulers", "stalerl.training", "recipe"},
    "stalerl": {"stalerl.launch"},  # `stalerl.cli` forwards to stalerl.launch.cli
    # the study tooling, above the runtime: reads summaries (results), loads configs, starts runs (launch.cli) and
    # warm starts (training.trainer); stalerl.schedulers and recipe only through those
    "stalerl_study": {"stalerl.core", "stalerl.config", "stalerl.results", "stalerl.training", "stalerl.launch"},
}


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("recipe", "stalerl_study"):
        return parts[0]
    sub = f"stalerl.{parts[1]}" if len(parts) > 1 else "stalerl"
    return sub if sub in ALLOWED else "stalerl"  # a top-level module (`stalerl.cli`)


def room_violations(graph: Dict[str, Set[str]]) -> List[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            a, b = room(mod), room(dep)
            if a != b and b not in ALLOWED[a]:
                out.append(f"{mod} -> {dep} ({a} may import only {sorted(ALLOWED[a]) or 'nothing of the project'})")
    return out


def test_import_graph_has_no_cycle_at_module_level_nor_with_lazy_imports():
    modules = project_modules()
    graph = import_edges(modules, include_lazy=False)
    # the graph is really built: known edges of the layout are present
    assert "stalerl.launch.launcher" in graph["stalerl.launch.cli"]
    assert "stalerl.config.slurm" in graph["stalerl.schedulers.slurm.render"]
    assert "stalerl.config.rules" in graph["stalerl.config.schema"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among module-level imports: " + " -> ".join(cycle)
    lazy = import_edges(modules, include_lazy=True)
    assert "stalerl.schedulers.slurm" in lazy["stalerl.launch.cli"]  # lazy edges are seen
    cycle = find_cycle(lazy)
    assert cycle is None, "import cycle (lazy imports included): " + " -> ".join(cycle)


def test_type_checking_imports_are_edges():
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import X\n"
    nodes = [n for n, lazy in _imports(ast.parse(code).body, False) if not lazy]
    assert any(isinstance(n, ast.ImportFrom) and n.module == "b" for n in nodes)


def test_config_schema_and_rules_depend_one_way():
    graph = import_edges(project_modules(), include_lazy=True)
    assert "stalerl.config.rules" in graph["stalerl.config.schema"]
    assert "stalerl.config.schema" not in graph["stalerl.config.rules"], "rules must not import the schema"


def test_rooms_import_only_downwards():
    modules = project_modules()
    graph = import_edges(modules, include_lazy=True)
    assert {room(m) for m in modules} == set(ALLOWED), "a room without a rule in ALLOWED, or a rule without a room"
    bad = room_violations(graph)
    assert not bad, "imports against the layout's directions:\n" + "\n".join(bad)


def test_room_check_catches_an_upward_import():
    graph = {"stalerl.results.sweep": {"stalerl.training.trainer"}, "stalerl.training.trainer": set(),
             "recipe.verl.plugin": {"stalerl.core.model"}, "stalerl.core.model": set()}
    bad = room_violations(graph)
    assert len(bad) == 2
    assert bad[0].startswith("recipe.verl.plugin -> stalerl.core.model (recipe may import only nothing")
    assert bad[1].startswith("stalerl.results.sweep -> stalerl.training.trainer (stalerl.results may import only")


def test_removed_circles_stay_removed_also_for_lazy_imports():
    graph = import_edges(project_modules(), include_lazy=True)
    assert "stalerl.launch.cli" not in graph["stalerl.launch.launcher"], "launcher imports cli (cli -> launcher only)"
    for mod, deps in graph.items():
        if mod == "stalerl.config" or mod.startswith("stalerl.config."):
            bad = sorted(d for d in deps if d.startswith("stalerl.schedulers"))
            assert not bad, f"{mod} imports the scheduler {bad}; Slurm value checks live in stalerl.config.slurm"


def test_top_level_reads_as_the_architecture():
    top = REPO / "stalerl"
    modules = sorted(p.name for p in top.glob("*.py"))
    # the package and the public command module (`python -m stalerl.cli`)
    assert modules == ["__init__.py", "cli.py"], f"new top-level module(s): put them in a room {modules}"
    # (a folder left holding only __pycache__ after a move is not a room)
    rooms = sorted(p.name for p in top.iterdir() if p.is_dir() and any(p.rglob("*.py")))
    assert rooms == sorted(r.split(".")[1] for r in ALLOWED if r.startswith("stalerl."))
    for r in rooms:  # every room says what lives there and what it may import
        doc = ast.get_docstring(ast.parse((top / r / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "import" in doc, f"stalerl/{r}/__init__.py needs a docstring saying what it may import"


def test_the_public_command_module_is_only_an_entry_point():
    """The project's own code imports stalerl.launch.cli; stalerl.cli exists only for `python -m stalerl.cli`."""
    graph = import_edges(project_modules(), include_lazy=True)
    for mod, deps in graph.items():
        assert mod == "stalerl.cli" or "stalerl.cli" not in deps, f"{mod} imports stalerl.cli; use stalerl.launch.cli"


def test_cycle_finder_reports_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _is_runtime(module: str) -> bool:
    return module.split(".")[0] in RUNTIME_ROOTS


def _study_module_strings(path: Path) -> List[str]:
    """String constants in ``path`` that name a ``stalerl_study`` module (an ``importlib.import_module`` or
    ``python -m`` target: an import the AST graph cannot see)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and (n.value == "stalerl_study" or n.value.startswith("stalerl_study."))})


def test_the_runtime_never_imports_the_study_tooling():
    """(issue 37 item 6) ``stalerl`` and ``recipe`` run without ``stalerl_study``: no import of it, lazy or not, and
    no module name of it in a string."""
    modules = project_modules()
    assert any(m.startswith("stalerl_study.") for m in modules), "the graph does not cover stalerl_study"
    graph = import_edges(modules, include_lazy=True)
    assert "stalerl.results.run_summary" in graph["stalerl_study.cli"]  # the study side's edges are seen
    assert "stalerl_study.stats" in graph["stalerl_study.report"]
    bad = [f"{mod} -> {dep}" for mod, deps in sorted(graph.items()) if _is_runtime(mod)
           for dep in sorted(deps) if room(dep) == "stalerl_study"]
    bad += [f"{mod} names {names}" for mod, path in sorted(modules.items()) if _is_runtime(mod)
            for names in [_study_module_strings(path)] if names]
    assert not bad, ("the runtime imports the study tooling (move what it needs into stalerl, or let stalerl_study "
                     "call it):\n" + "\n".join(bad))


def test_the_runtime_check_catches_an_import_of_the_study_tooling():
    graph = {"stalerl.results.sweep": {"stalerl_study.report"}, "stalerl_study.report": {"stalerl.core.io"},
             "stalerl.core.io": set()}
    assert room_violations(graph) == ["stalerl.results.sweep -> stalerl_study.report (stalerl.results may import "
                                      "only ['recipe', 'stalerl.config', 'stalerl.core'])"]


#: The framework adapters (each package and its submodules) and the losses whose ``algorithm`` module they must not
#: import: they reach a loss through ``recipe.registry`` and its declaration.
ADAPTERS = ("recipe.verl", "recipe.trl", "recipe.swift", "recipe.areal", "recipe.trinity")
LOSS_PACKAGES = ("m2po", "fipo", "baselines", "m2po_authors")


def adapter_algorithm_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``adapter module -> recipe.<loss>.algorithm`` for every such edge in ``graph``."""
    algorithms = {f"recipe.{loss}.algorithm" for loss in LOSS_PACKAGES}
    return [f"{mod} -> {dep}" for mod, deps in sorted(graph.items())
            if any(mod == a or mod.startswith(a + ".") for a in ADAPTERS) for dep in sorted(deps & algorithms)]


def test_adapters_never_import_a_loss_algorithm_module():
    modules = project_modules()
    assert {f"recipe.{loss}.algorithm" for loss in LOSS_PACKAGES} <= set(modules)
    bad = adapter_algorithm_imports(import_edges(modules, include_lazy=True))
    assert not bad, ("framework adapters import a loss's algorithm module (lazy imports included); they should go "
                     "through recipe.registry and the loss declarations:\n" + "\n".join(bad))


def test_the_adapter_check_catches_an_algorithm_import():
    graph = {"recipe.verl.losses": {"recipe.m2po.algorithm", "recipe.registry"},
             "recipe.verlx": {"recipe.m2po.algorithm"},  # not an adapter: recipe.verl's name is only its prefix
             "recipe.m2po": {"recipe.m2po.algorithm"}, "recipe.m2po.algorithm": set(), "recipe.registry": set()}
    assert adapter_algorithm_imports(graph) == ["recipe.verl.losses -> recipe.m2po.algorithm"]
