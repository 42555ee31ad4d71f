"""docs/adding-a-loss.md works as written (issue 44 item 8): its files are copied out of the page's own text, built
and pip-installed (``--no-deps --no-build-isolation``: no download) into a temporary virtual environment that sees
this checkout's environment through a ``.pth`` file, its own test runs there, and the runtime trains with it. Nothing
in this repository is edited; the package is found only through its installed ``recipe.losses`` entry point.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import small_overrides

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "adding-a-loss.md"
BLOCK = re.compile(r"```(?:python|toml)\n# (scaled-pg/[^\n]+)\n(.*?)```", re.S)


def guide_files() -> dict[str, str]:
    """{path: text} of every code block of the guide that starts with a ``# scaled-pg/<path>`` line."""
    files = {path: f"# {path}\n{body}" for path, body in BLOCK.findall(GUIDE.read_text())}
    layout = re.search(r"```text\n(scaled-pg/.*?)```", GUIDE.read_text(), re.S).group(1)
    listed = {f"scaled-pg/{line.split('#')[0].strip()}" for line in layout.splitlines()[1:] if line.strip()}
    assert listed == set(files), f"the layout lists {sorted(listed)}, the page gives {sorted(files)}"
    return files


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("guide")
    for path, text in guide_files().items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # the new environment sees this checkout's (torch, setuptools, the editable stalerl) as a site directory
    (purelib / "_checkout_env.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                          "--no-build-isolation", "--no-index", "--quiet", str(root / "scaled-pg")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return {"root": root, "python": python, "purelib": purelib, "env": env}


def test_the_guides_package_installs_and_its_own_test_passes(installed):
    python, env = installed["python"], installed["env"]
    where = subprocess.run([str(python), "-c", "import scaled_pg, sys; print(scaled_pg.__file__); "
                            "from recipe.registry import is_policy_loss_registered; "
                            "assert is_policy_loss_registered('scaled_pg'); print('torch' in sys.modules)"],
                           cwd=installed["root"], env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    module_file, torch_loaded = where.stdout.split()
    assert Path(module_file).is_relative_to(installed["purelib"])  # installed, not read from the source tree
    assert torch_loaded == "False"  # the entry point names the torch-free declaration
    res = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "scaled-pg/tests"],
                         cwd=installed["root"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "2 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


def test_the_runtime_trains_with_the_guides_loss_and_refuses_a_bad_value(installed, tmp_path):
    python, env = installed["python"], installed["env"]
    script = REPO / "examples" / "math" / "gsm8k_rl.py"
    config = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"
    args = [str(python), str(script), "--config", str(config), *small_overrides(tmp_path, total_train_steps=1),
            "actor.loss=scaled_pg", "actor.pg_scale=0.5", "experiment_name=guide", "trial_name=t0"]
    res = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "guide" / "t0" / "metrics.jsonl").read_text().splitlines()]
    assert any("actor/scaled_pg/ratio_mean" in r and "actor/scaled_pg/num_tokens" in r for r in rows)
    bad = subprocess.run([*args[:-3], "actor.pg_scale=0", "experiment_name=guide_bad", "trial_name=t0"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "actor.pg_scale" in bad.stderr and "Traceback" not in bad.stderr, \
        bad.stderr[-2000:]
