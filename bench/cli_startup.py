"""Wall time of the command line's fast paths (``--help``, ``--dry-run``) against ``python -c "import torch"``.

    python bench/cli_startup.py [--repeat 5] [--before REF]

Each command runs ``--repeat`` times as a fresh subprocess (median wall seconds). ``--before REF`` also times the
same commands in the tree of git ref REF (exported with ``git archive`` to a temporary directory), so the figure is
before/after in the same session on the same machine. Printed, never asserted on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "--help": ["examples/math/gsm8k_rl.py", "--help"],
    "--dry-run": ["examples/math/gsm8k_rl.py", "--config", "examples/math/gsm8k_m2po.yaml", "--dry-run"],
}


def wall(argv: list[str], cwd: Path, repeat: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(cwd))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--before", default=None, help="git ref of the tree to compare with (e.g. main or a commit)")
    args = ap.parse_args()
    base = wall(["-c", "import torch"], REPO, args.repeat)
    print(f"baseline python -c 'import torch': {base:.2f}s (median of {args.repeat})")
    trees = {"after": REPO}
    tmp = None
    if args.before:
        tmp = tempfile.TemporaryDirectory()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp.name], input=archive.stdout, check=True)
        trees = {f"before ({args.before})": Path(tmp.name), "after": REPO}
    results: dict[str, dict[str, float]] = {}
    for label, tree in trees.items():
        results[label] = {name: wall(argv, tree, args.repeat) for name, argv in COMMANDS.items()}
        for name, sec in results[label].items():
            print(f"{label:>22} {name:<10} {sec:.2f}s  = {sec / base:.2f} x import torch")
    if len(trees) == 2:
        before, after = (results[k] for k in trees)
        for name in COMMANDS:
            print(f"{name:<10} after/before = {after[name] / before[name]:.2f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
