"""Wall time of the command line's fast paths (``--help``, ``--dry-run``) against ``python -c "import torch"``.

    python bench/cli_startup.py [--repeat 5] [--before REF]

Each command runs ``--repeat`` times as a fresh subprocess (median wall seconds), without and with a policy-loss
plugin installed (a ``recipe.losses`` entry point in the layout docs/adding-a-loss.md gives: the entry point names a
torch-free declaration module, the arithmetic loads on first use; issue 44 item 5 wants both under 1 s).
``--before REF`` also times the same commands in the tree of git ref REF (exported with ``git archive`` to a
temporary directory), so the figure is before/after in the same session on the same machine. Printed, never
asserted on.
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


# A plugin as the guide lays it out: its entry point names the declaration (torch-free); ``algorithm`` loads later.
PLUGIN_FILES = {
    "bench_plugin/__init__.py": "",
    "bench_plugin/declaration.py": (
        "from recipe.declaration import MEAN, LossDeclaration, param\n"
        "DECLARATION = LossDeclaration(name='bench_pg', summary='bench: a declared plugin loss',\n"
        "    params=(param('bench_scale', 1.0, gt=0.0, help='bench: scale'),),\n"
        "    metrics={'bench_pg/ratio_mean': MEAN}, algorithm='bench_plugin.algorithm')\n"),
    "bench_plugin/algorithm.py": "import torch  # never imported by --help or --dry-run\n",
    "bench_plugin-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: bench_plugin\nVersion: 0.0.1\n",
    "bench_plugin-0.0.1.dist-info/entry_points.txt": "[recipe.losses]\nbench_pg = bench_plugin.declaration\n",
}


#: The older one-module layout (its entry point names a module that imports torch and registers): what the
#: declaration layout avoids; the "before" tree can load only this one.
MODULE_PLUGIN_FILES = {
    "bench_module_plugin.py": (
        "import torch\n"
        "from recipe.declaration import LossDeclaration\n"
        "from recipe.registry import register_policy_loss\n"
        "DECLARATION = LossDeclaration(name='bench_module_pg', summary='bench: a one-module plugin loss')\n"
        "@register_policy_loss(DECLARATION)\n"
        "def compute_policy_loss_bench(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode='token-mean',"
        " config=None, rollout_is_weights=None):\n"
        "    raise NotImplementedError\n"),
    "bench_module_plugin-0.0.1.dist-info/METADATA":
        "Metadata-Version: 2.1\nName: bench_module_plugin\nVersion: 0.0.1\n",
    "bench_module_plugin-0.0.1.dist-info/entry_points.txt": "[recipe.losses]\nbench_module_pg = bench_module_plugin\n",
}


def install_plugin(site: Path, files: "dict[str, str]" = PLUGIN_FILES) -> Path:
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return site


def wall(argv: list[str], cwd: Path, repeat: int, site: "Path | None" = None) -> float:
    """Median wall seconds; NaN when the command fails (a tree that cannot load that plugin layout)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (site, cwd) if p is not None))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        if done.returncode != 0:
            return float("nan")
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
    sites = {"+plugin": install_plugin(Path(tempfile.mkdtemp(prefix="cli-startup-plugin-"))),
             "+module plugin": install_plugin(Path(tempfile.mkdtemp(prefix="cli-startup-plugin-")),
                                              MODULE_PLUGIN_FILES)}
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average; timings under load are not idle figures)")
    results: dict[str, dict[str, float]] = {}
    for label, tree in trees.items():
        results[label] = {name: wall(argv, tree, args.repeat) for name, argv in COMMANDS.items()}
        for tag, site in sites.items():
            results[label].update({f"{name} {tag}": wall(argv, tree, args.repeat, site)
                                   for name, argv in COMMANDS.items()})
        for name, sec in results[label].items():
            print(f"{label:>22} {name:<25} {sec:.2f}s  = {sec / base:.2f} x import torch"
                  + ("  (this tree cannot load that plugin)" if sec != sec else ""))
    if len(trees) == 2:
        before, after = (results[k] for k in trees)
        for name in after:
            print(f"{name:<25} after/before = {after[name] / before[name]:.2f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
