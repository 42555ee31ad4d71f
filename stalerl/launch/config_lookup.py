"""Where a ``--config`` file is found (torch-free).

A path that exists from the current directory is used as given. Otherwise a bare or relative name is looked up
next to the entry script (``examples/math/`` for ``examples/math/gsm8k_rl.py``) and then among the example configs
shipped with the source tree (``examples/*/``, except the other frameworks' folders ``examples/areal`` and
``examples/verl``), also by file name alone, so ``--config gsm8k_m2po.yaml`` works from the repository root and
``--config examples/math/gsm8k_m2po.yaml`` works from inside ``examples/math``.
Run directories stay relative to the current directory (``cluster.fileroot``), wherever the config came from.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from stalerl.core.errors import UserError

# The source tree's examples/ (present in a clone or an editable install; a wheel ships none).
EXAMPLES_ROOT = Path(__file__).resolve().parents[2] / "examples"  # stalerl/launch/config_lookup.py -> the root


# Example folders whose YAML files are other frameworks' configs (AReaL's format, verl's Hydra), never stalerl's: a
# bare name such as gsm8k_m2po.yaml must not resolve to AReaL's file of the same name.
OTHER_FRAMEWORK_EXAMPLES = ("areal", "verl")


def example_config_dirs() -> list[Path]:
    if not EXAMPLES_ROOT.is_dir():
        return []
    return sorted(p for p in EXAMPLES_ROOT.iterdir() if p.is_dir() and p.name not in OTHER_FRAMEWORK_EXAMPLES)


def _script_dir(script: Optional[str]) -> Optional[Path]:
    script = sys.argv[0] if script is None else script
    if script and script.endswith(".py") and Path(script).is_file():
        return Path(script).resolve().parent
    return None


def candidates(path: str, script: Optional[str] = None) -> list[Path]:
    """Every place ``path`` is looked for, in order (duplicates removed)."""
    given = Path(path).expanduser()
    out = [given]
    if not given.is_absolute():
        dirs = [d for d in [_script_dir(script)] if d is not None] + example_config_dirs()
        for d in dirs:
            out.append(d / given)
        for d in dirs:
            out.append(d / given.name)
    seen, unique = set(), []
    for p in out:
        # Resolved against the current directory, existing or not: "x.yml" and <script dir>/x.yml are one place
        # when the command runs from the script's folder (issue 28: the "looked in" list named it twice).
        key = str(p.resolve())
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def _shown(p: Path) -> str:
    """A path relative to the current directory when it is under it (shorter to read and to copy)."""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p.resolve())


def resolve_config_path(path: str, script: Optional[str] = None) -> str:
    """The config file ``path`` names (see the module docstring); a :class:`UserError` listing where it looked and
    the example configs that exist when there is none."""
    for p in candidates(path, script):
        if p.is_file():
            return str(p) if p == Path(path).expanduser() else _shown(p)
    looked = ", ".join(_shown(p) if p.is_absolute() else str(p) for p in candidates(path, script))
    shipped = sorted({f.name for d in example_config_dirs() for f in d.glob("*.yaml")})
    hint = f"; example configs: {', '.join(shipped)}" if shipped else ""
    raise UserError(f"config file not found: {path!r} (looked in: {looked}){hint}")
