"""What outside code and old run directories reach keeps working whatever the runtime's internal layout.

- ``python -m stalerl.cli`` and ``from stalerl.cli import main`` (docs, user scripts, Slurm job files);
- the console scripts: pyproject's targets resolve; the verl adapter without verl names how to install it;
- run directories: a checkpoint and the run's files name no ``stalerl``/``recipe`` module, so a run written before
  (or after) any move resumes and reports; ``stalerl-report`` reads the summaries written by an older runtime.

No forwarding shims for old module paths: version 0.1.0 is the first release, so nothing installed outside this
tree names them.
"""

from __future__ import annotations

import importlib
import json
import pickle
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV_PATH = {"PYTHONPATH": str(REPO)}


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **ENV_PATH)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, cwd=REPO, env=env, **kw)


def test_python_m_stalerl_cli_and_its_main_still_work():
    import stalerl.cli
    import stalerl.launch.cli

    assert stalerl.cli.main is stalerl.launch.cli.main and stalerl.cli.one_line is stalerl.launch.cli.one_line
    out = _run("-m", "stalerl.cli", "--help")
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout and "actor.loss" in out.stdout
    from stalerl.launch.config_lookup import EXAMPLES_ROOT

    assert EXAMPLES_ROOT == REPO / "examples"  # bare config names are still found among the examples
    out = _run("-m", "stalerl.cli", "--config", "gsm8k_m2po_cpu.yaml", "actor.los=m2po")
    assert out.returncode == 2 and "actor.loss" in out.stderr  # a user error: one line, exit code 2, did-you-mean


def _console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]


def test_console_script_targets_resolve_to_their_new_modules():
    scripts = _console_scripts()
    assert set(scripts) >= {"stalerl-plot", "stalerl-report", "stalerl-study", "stalerl-verl-config-path"}
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        if module.startswith("recipe.verl"):
            pytest.importorskip("verl")
        assert callable(getattr(importlib.import_module(module), func)), f"{name} = {target}"
    assert scripts["stalerl-report"] == "stalerl_study.report:main"


def test_verl_adapter_without_verl_names_the_extra_and_how_to_install_it():
    out = _run("-c", "import sys; sys.modules['verl'] = None\ntry:\n    import recipe.verl.plugin\n"
                     "except ImportError as exc:\n    print('IMPORT-ERROR:', exc)\n")
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR:" in out.stdout and 'pip install -e ".[verl]"' in out.stdout
    assert "stalerl-0.1.0-py3-none-any.whl[verl]" in out.stdout


def test_the_removed_shims_stay_removed():
    """recipe.m2po.verl and stalerl's old console-script names were never released: they do not import. Nor do the
    study tooling's places inside the runtime before it moved to stalerl_study (issue 37 item 6)."""
    for old in ("recipe.m2po.verl", "stalerl.report", "stalerl.plot", "stalerl.study", "stalerl.results.report",
                "stalerl.launch.study"):
        out = _run("-c", f"import {old}")
        assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, (old, out.stderr[-500:])


class _GlobalsRecorder(pickle.Unpickler):
    seen: set = set()

    def find_class(self, module: str, name: str):
        _GlobalsRecorder.seen.add(f"{module}.{name}")
        return super().find_class(module, name)


def _pickled_globals(state_pt: Path) -> set:
    """Every class/function a torch checkpoint's pickle names (torch.load through a recording unpickler)."""
    import types

    import torch

    _GlobalsRecorder.seen = set()
    recorder = types.SimpleNamespace(Unpickler=_GlobalsRecorder, load=pickle.load, __name__="recorder")
    torch.load(state_pt, map_location="cpu", weights_only=False, pickle_module=recorder)
    return set(_GlobalsRecorder.seen)


def test_checkpoints_and_run_files_name_no_project_module(tmp_path):
    """So a run directory does not depend on where the runtime's modules live: resume and reports read it whatever
    the layout was when it was written (an old run directory resumes after the move, and vice versa)."""
    import re

    from conftest import CPU_CONFIG, small_overrides

    from stalerl.config import load_config
    from stalerl.results.run_summary import write_run_summary
    from stalerl.training.trainer import Trainer

    # stale data in the FIFO (fixed staleness 4 in the CPU config) and a checkpoint at every step
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(
        tmp_path, total_train_steps=2, **{"recover.mode": "auto", "recover.freq_steps": 1})])
    trainer = Trainer(cfg)
    trainer.train()
    write_run_summary(cfg, status="finished", wall_s=1.0)
    states = sorted(trainer.run_dir.glob("checkpoints/step_*/state.pt"))
    assert states, "no checkpoint written"
    names = _pickled_globals(states[-1])
    assert any(n.startswith("collections.") for n in names)  # the recorder sees the pickled classes (the FIFO deque)
    project = sorted(n for n in names if n.split(".")[0] in ("stalerl", "recipe"))
    assert not project, f"a checkpoint pickles project classes, so moving a module breaks old run dirs: {project}"
    module_ref = re.compile(r"\b(?:stalerl|recipe)\.[a-z_]+\.[a-zA-Z_]")  # a dotted path into the project
    for path in sorted(p for p in trainer.run_dir.rglob("*") if p.suffix in (".json", ".jsonl", ".yaml", ".txt")):
        hits = module_ref.findall(path.read_text(encoding="utf-8", errors="replace"))
        assert not hits, f"{path.relative_to(trainer.run_dir)} names project modules {hits[:3]}"
    assert json.loads((trainer.run_dir / "summary.json").read_text())["status"] == "finished"


def test_report_reads_the_summaries_written_before_the_move(tmp_path):
    from stalerl_study.report import main as report_main

    # The first `staleness` study's summaries (results commit bf6e677), written by the runtime before the move, are
    # kept as a fixture (m2po, vanilla and no_trust_region) now that the study has been rerun on the current code.
    results = REPO / "tests" / "unit" / "data" / "staleness_schema1"
    assert len(list(results.glob("m2po-*.json"))) == 20  # 4 settings x 5 seeds
    out = tmp_path / "report"
    assert report_main([str(results), "--no-figures", "--out", str(out)]) in (0, None)
    tables = "".join(p.read_text(encoding="utf-8") for p in sorted(out.glob("*.md")))
    assert "m2po" in tables and "5/5" in tables
