"""Did the registration precede every run? Checked from the collected summaries and git, not taken on trust.

A registered study's claims live in its spec (``examples/math/study/<name>.yaml``), committed before any of its
runs. Every run summary records the commit its code ran from and whether the tree was clean (``code``, see
:mod:`stalerl.results.run_summary`). So the registration preceded a run exactly when that run ran from a clean tree
whose commit already holds the spec, byte for byte as it is registered now:

    stalerl-study registration docs/algorithms/results/smollm2_study --spec examples/math/study/smollm2_study.yaml

prints the commit that first added the spec and, per run, the commit it ran from; it exits 1 with one line per run
that fails (no commit recorded, a dirty tree, a commit without the spec, or with another version of it).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence


def _git(repo: Path, *args: str) -> Optional[str]:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def repo_root(path: Path) -> Path:
    top = _git(path if path.is_dir() else path.parent, "rev-parse", "--show-toplevel")
    if top is None:
        raise ValueError(f"{path}: not inside a git checkout; the registration check reads the spec's history")
    return Path(top.strip())


def first_commit(repo: Path, rel: str) -> Optional[str]:
    """The commit that first added ``rel`` (following no renames), or None when git has never held it."""
    out = _git(repo, "log", "--diff-filter=A", "--format=%H %cI", "--", rel)
    lines = (out or "").strip().splitlines()
    return lines[-1] if lines else None


def check_runs(summaries: Sequence[Mapping[str, Any]], spec: Path) -> tuple[Optional[str], list[str], list[str]]:
    """(the commit that added the spec, one line per run that passes, one line per run that fails)."""
    spec = spec.resolve()
    repo = repo_root(spec)
    rel = spec.relative_to(repo).as_posix()
    registered = spec.read_bytes()
    added = first_commit(repo, rel)
    ok, bad = [], []
    for s in sorted(summaries, key=lambda s: str(s.get("run"))):
        run, code = s.get("run", "?"), s.get("code") or {}
        commit = code.get("commit")
        if not commit:
            bad.append(f"{run}: its summary records no code commit")
            continue
        if code.get("dirty") is not False:
            bad.append(f"{run}: ran from a tree with uncommitted changes at {commit[:12]} (or not recorded)")
            continue
        held = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{rel}"], capture_output=True)
        if held.returncode != 0:
            bad.append(f"{run}: commit {commit[:12]} does not hold {rel} (the run came before its registration, or "
                       "the commit is not in this checkout)")
        elif held.stdout != registered:
            bad.append(f"{run}: commit {commit[:12]} holds another version of {rel} than the registered one")
        else:
            ok.append(f"{run}: ran at {commit[:12]}, which holds the registered spec")
    return added, ok, bad
