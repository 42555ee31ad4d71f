"""The code identity of a GPU check: which tree was sent, and whether the device ran exactly that tree.

**Before the device call, here** (``python scripts/gpu_check_identity.py``): records the sending side's commit,
dirty flag (tracked files differing from HEAD; untracked files git does not ignore) and a digest of the tracked
files' contents as they are in the working tree (what a copy of the working tree carries), with the list of those
paths, in ``.gpu_check/identity.json`` (git-ignored: carry ``.gpu_check`` with the call, as ``.whl``).

**On the device** (scripts/gpu_check.sh's environment part: ``gpu_check_identity.py --verify FILE --out JSON``):
recomputes the digest over the same paths in the copy it runs from. The report shows both, says whether they
match, and compares them with the commit and dirty flag the runs' ``summary.json`` recorded (the device copy's own
``.git``, which may lag the tree it carries: the tree digest is what identifies the code).

The digest: SHA-256 over ``path NUL sha256(content) NUL`` for each tracked path in sorted order (a path missing from
the working tree enters as ``path NUL missing NUL``). Only the standard library and ``git`` (sending side).

    python scripts/gpu_check_identity.py [--out .gpu_check/identity.json]
    python scripts/gpu_check_identity.py --verify .gpu_check/identity.json --out JSON
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
DEFAULT = Path(".gpu_check") / "identity.json"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def file_digests(root: Path, paths: list[str]) -> dict[str, str]:
    """Each path's content digest as :func:`tree_digest` takes it ("missing" for a path not on disk)."""
    out = {}
    for rel in sorted(paths):
        p = root / rel
        if p.is_symlink():
            out[rel] = hashlib.sha256(os.readlink(p).encode()).hexdigest()
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "missing"
    return out


def tree_digest(root: Path, paths: list[str]) -> tuple[str, list[str]]:
    """The digest of ``paths`` (relative to ``root``) as they are on disk, and the paths that are missing."""
    h = hashlib.sha256()
    missing = []
    for rel in sorted(paths):
        p = root / rel
        if p.is_symlink():
            content = hashlib.sha256(os.readlink(p).encode()).hexdigest()
        elif p.is_file():
            content = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            content = "missing"
            missing.append(rel)
        h.update(rel.encode() + b"\0" + content.encode() + b"\0")
    return h.hexdigest(), missing


def sending_identity(root: Path = REPO) -> dict[str, Any]:
    paths = [p for p in _git(root, "ls-files", "-z").split("\0") if p]
    commit = _git(root, "rev-parse", "HEAD").strip()
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    digest, missing = tree_digest(root, paths)
    return {"commit": commit, "dirty": bool(status.strip()), "dirty_files": status.splitlines()[:50],
            "tree_digest": digest, "files": len(paths), "missing": missing, "paths": sorted(paths),
            "file_digests": file_digests(root, paths),
            "made_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def verify(sent: dict[str, Any], root: Path = REPO) -> dict[str, Any]:
    """The device side: the digest of the sent paths in this copy, and whether it equals the sent one."""
    digest, missing = tree_digest(root, sent["paths"])
    differing = []
    if digest != sent["tree_digest"] and sent.get("file_digests"):
        here = file_digests(root, sent["paths"])
        differing = [p for p in sent["paths"] if here.get(p) != sent["file_digests"].get(p)]
    return {"sent": {k: v for k, v in sent.items() if k not in ("paths", "file_digests")},
            "device_tree_digest": digest, "device_missing": missing, "device_differing": differing[:50],
            "matches": digest == sent["tree_digest"]}


def compare_with_runs(identity: Optional[dict[str, Any]], run_codes: dict[str, dict[str, Any]]) -> list[str]:
    """Notes on the runs' recorded code (summary.json's ``code``) against the sent commit (the report prints them)."""
    if not identity:
        return []
    sent = identity.get("sent", {})
    notes = []
    for run, code in sorted(run_codes.items()):
        if not code:
            continue
        if code.get("commit") != sent.get("commit") or code.get("dirty") != sent.get("dirty"):
            notes.append(f"{run}: summary.json says commit {str(code.get('commit'))[:12]}, dirty {code.get('dirty')}; "
                         f"sent {str(sent.get('commit'))[:12]}, dirty {sent.get('dirty')} (the device copy's .git; "
                         f"the tree digest {'matches' if identity.get('matches') else 'DOES NOT match'})")
    return notes


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verify", type=Path, default=None, help="the sent identity (device side)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.verify is None:
        out = args.out or REPO / DEFAULT
        ident = sending_identity(REPO)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(ident, indent=1))
        os.replace(tmp, out)
        print(f"gpu_check identity: commit {ident['commit'][:12]}, dirty {ident['dirty']}, {ident['files']} tracked "
              f"files, digest {ident['tree_digest'][:16]} -> {out} (carry {out.parent.name} with the device call)")
        return 0
    if not args.verify.is_file():
        result: dict[str, Any] = {"sent": None, "matches": None,
                                  "why": f"no {args.verify}: run python scripts/gpu_check_identity.py before the "
                                         f"device call and carry .gpu_check"}
    else:
        result = verify(json.loads(args.verify.read_text()), REPO)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    if result.get("sent") is None:
        print(f"gpu_check: identity: {result['why']}")
    else:
        s = result["sent"]
        print(f"gpu_check: identity: sent commit {s['commit'][:12]}, dirty {s['dirty']}, tree digest "
              f"{s['tree_digest'][:16]}; this copy {result['device_tree_digest'][:16]} "
              f"({'matches' if result['matches'] else 'DIFFERS: ' + ', '.join(result['device_differing'][:5]) + '; ' + str(len(result['device_missing'])) + ' missing'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
