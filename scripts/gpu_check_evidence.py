"""The GPU check's evidence: the files to commit, written by the check itself (scripts/gpu_check.sh, last step) into
``OUT_DIR/evidence/``, so what lands in ``docs/gpu/<card>-<date>/`` is the raw output byte for byte except for one
stated, mechanical redaction, and nothing is edited by hand.

Copied: the report (``gpu_check_report.json``), ``parts.tsv``, ``console.log`` (the check's own stdout and stderr),
``logs/*.log``, ``parts/*.json`` and ``parts/*.csv``, and every run's files under ``runs/`` (``summary.json``,
``config.yaml``, ``metrics.jsonl``, its logs) except weights and checkpoints (``*.pt``, ``*.safetensors``, ``*.bin``)
and any file over :data:`MAX_BYTES`. Redaction, in text files only: the check's output folder becomes ``<out>``,
its scratch folder ``<work>``, the repository's folder ``<repo>``, the home folder ``<home>``, and the folders given
with ``--also NAME=PATH`` (the check passes its wheels, the GGUF's folder and the model cache) ``<NAME>`` (longest
first, so a folder inside another is named by the inner one). ``evidence/REDACTION.json`` lists the replaced strings' names and
how many times each was replaced per file; ``evidence/MANIFEST.sha256`` has each file's SHA-256 (``sha256sum -c``
checks a committed copy; tests/unit/test_gpu_docs_evidence.py does in CI).

    python scripts/gpu_check_evidence.py OUT_DIR --repo REPO --work WORK [--also NAME=PATH ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

MAX_BYTES = 8 * 2 ** 20
SKIP_SUFFIXES = (".pt", ".safetensors", ".bin", ".tmp")
TOP = ("gpu_check_report.json", "parts.tsv", "console.log")


def selected_files(out_dir: Path) -> list[Path]:
    files = [out_dir / n for n in TOP if (out_dir / n).is_file()]
    files += sorted((out_dir / "logs").glob("*.log"))
    files += sorted(p for p in (out_dir / "parts").glob("*") if p.suffix in (".json", ".csv") and p.is_file())
    files += sorted(p for p in (out_dir / "runs").rglob("*") if p.is_file() and p.suffix not in SKIP_SUFFIXES
                    and "checkpoints" not in p.relative_to(out_dir).parts)
    return [p for p in files if p.stat().st_size <= MAX_BYTES]


def redactions(out_dir: Path, repo: Path, work: Optional[Path], home: Optional[str],
               also: Optional[dict[str, str]] = None) -> list[tuple[str, str]]:
    pairs = [(str(out_dir), "<out>"), (str(repo), "<repo>")]
    pairs += [(path.rstrip("/"), f"<{name}>") for name, path in (also or {}).items() if path.rstrip("/")]
    if work:
        pairs.append((str(work), "<work>"))
    if home and home not in ("/", ""):
        pairs.append((home, "<home>"))
    for path, name in list(pairs):  # the resolved spelling too (a /tmp that is a link, ...)
        real = os.path.realpath(path)
        if real != path:
            pairs.append((real, name))
    return sorted(pairs, key=lambda p: -len(p[0]))


def redact(data: bytes, pairs: list[tuple[str, str]]) -> tuple[bytes, dict[str, int]]:
    counts: dict[str, int] = {}
    for old, new in pairs:
        n = data.count(old.encode())
        if n:
            data = data.replace(old.encode(), new.encode())
            counts[new] = counts.get(new, 0) + n
    return data, counts


def write_evidence(out_dir: Path, repo: Path, work: Optional[Path], home: Optional[str] = None,
                   also: Optional[dict[str, str]] = None) -> Path:
    dest = out_dir / "evidence"
    if dest.exists():
        shutil.rmtree(dest)
    pairs = redactions(out_dir, repo, work, home, also)
    manifest, report = [], {}
    for src in selected_files(out_dir):
        rel = src.relative_to(out_dir)
        data = src.read_bytes()
        try:
            data.decode("utf-8")
            data, counts = redact(data, pairs)
        except UnicodeDecodeError:
            counts = {"binary: not redacted": 1}
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        manifest.append(f"{hashlib.sha256(data).hexdigest()}  {rel.as_posix()}")
        if counts:
            report[rel.as_posix()] = counts
    (dest / "REDACTION.json").write_text(json.dumps({
        "rule": "in text files, each of these folders replaced by its name (longest first); nothing else changed",
        "names": sorted({name for _, name in pairs}), "replaced": report}, indent=2) + "\n")
    (dest / "MANIFEST.sha256").write_text("\n".join(manifest) + "\n")
    return dest


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--repo", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--also", action="append", default=[], metavar="NAME=PATH", help="another folder to name")
    args = ap.parse_args(argv)
    also = dict(a.split("=", 1) for a in args.also if "=" in a)
    dest = write_evidence(args.out_dir.resolve(), args.repo.resolve(), args.work, os.environ.get("HOME"), also)
    n = len((dest / "MANIFEST.sha256").read_text().splitlines())
    print(f"gpu_check: evidence: {n} files, paths redacted, in {dest} (commit it as docs/gpu/<card>-<date>/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
