"""What outside code and old run directories reach keeps working after the runtime was grouped into subpackages.

- ``python -m stalerl.cli`` and ``from stalerl.cli import main`` (docs, user scripts, Slurm job files written before);
- the console scripts: pyproject's targets, and the old targets that wrappers installed before the move import;
- the verl adapter's old home ``recipe.m2po.verl`` (old ``verl.plugins`` entry point, old ``_target_`` in verl
  configs, old ``stalerl-verl-config-path`` wrapper): see ``tests/integration/test_verl_plugin.py`` for verl itself;
- run directories: a checkpoint and the run's files name no ``stalerl``/``recipe`` module, so a run written before
  (or after) any move resumes and reports; ``stalerl-report`` reads the summaries shipped in docs/, written before.
"""
# restructure: keep-old-paths (this test names the old paths on purpose; /work/wt-tools/restructure.py skips it)

from __future__ import annotations

import importlib
import importlib.util
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
    assert scripts["stalerl-report"] == "stalerl.results.report:main"


def test_old_console_script_modules_import_the_new_ones(monkeypatch):
    """A wrapper installed before the move runs ``from stalerl.report import main``: the finder serves the new
    module (the same object) under the old name, with a DeprecationWarning saying how to refresh the wrappers."""
    import stalerl
    from stalerl._compat import MOVED_MODULES, MovedModuleFinder

    assert any(isinstance(f, MovedModuleFinder) for f in sys.meta_path), "import stalerl installs the finder"
    # Ask our finder first: a development environment's editable finder may still map old names to another checkout.
    monkeypatch.setattr(sys, "meta_path", [MovedModuleFinder(), *sys.meta_path])
    for old, new in MOVED_MODULES.items():
        monkeypatch.delitem(sys.modules, old, raising=False)
        monkeypatch.delattr(stalerl, old.rpartition(".")[2], raising=False)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            mod = importlib.import_module(old)
        assert mod is importlib.import_module(new) and mod.__name__ == new
        assert callable(mod.main)
    assert MovedModuleFinder().find_spec("stalerl.reports", None) is None  # only the listed names


def test_old_console_script_wrapper_runs_in_a_fresh_interpreter():
    # exactly what pip wrote into bin/stalerl-report before the move
    code = "import sys\nfrom stalerl.report import main\nsys.argv[0] = 'stalerl-report'\nsys.exit(main())\n"
    out = _run("-c", "import sys; from stalerl._compat import MovedModuleFinder; sys.meta_path.insert(0, "
                     "MovedModuleFinder())\n" + code, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: stalerl-report" in out.stdout


def test_old_verl_adapter_paths_are_the_new_objects():
    pytest.importorskip("verl")
    import recipe.m2po.verl as old
    import recipe.m2po.verl.cli as old_cli
    import recipe.m2po.verl.config as old_config
    import recipe.m2po.verl.plugin as old_plugin
    import recipe.verl as new
    import recipe.verl.cli
    import recipe.verl.config
    import recipe.verl.plugin

    entry = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]
    assert entry["verl.plugins"]["stalerl"] == "recipe.verl.plugin"
    assert old.config_dir() == new.config_dir() == REPO / "recipe" / "verl" / "config"
    assert (new.config_dir() / "m2po_trainer.yaml").is_file() and (new.config_dir() / "fipo_trainer.yaml").is_file()
    assert old.M2POPolicyLossConfig is old_config.M2POPolicyLossConfig is recipe.verl.config.M2POPolicyLossConfig
    assert old_config.FIPOPolicyLossConfig is recipe.verl.config.FIPOPolicyLossConfig
    assert old_plugin.register is recipe.verl.plugin.register and old_cli.main is recipe.verl.cli.main
    assert old_plugin.REGISTERED == recipe.verl.plugin.REGISTERED and set(old_plugin.REGISTERED) == set(
        new.VERL_LOSS_NAMES)
    # an old verl config's `_target_` still builds the same config class (Hydra resolves it by import path)
    from hydra.utils import get_class

    assert get_class("recipe.m2po.verl.config.M2POPolicyLossConfig") is recipe.verl.config.M2POPolicyLossConfig
    for name in ("m2po_trainer.yaml", "fipo_trainer.yaml"):
        text = (new.config_dir() / name).read_text(encoding="utf-8")
        assert "recipe.verl.config." in text and "recipe.m2po.verl" not in text
    out = _run("-m", "recipe.m2po.verl.cli")  # the old stalerl-verl-config-path target prints the new directory
    assert out.returncode == 0 and out.stdout.strip() == str(new.config_dir()), out.stderr


def test_old_verl_adapter_path_without_verl_names_the_extra():
    out = _run("-c", "import sys; sys.modules['verl'] = None\ntry:\n    import recipe.m2po.verl.plugin\n"
                     "except ImportError as exc:\n    print('IMPORT-ERROR:', exc)\n")
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR:" in out.stdout and 'pip install "stalerl[verl]"' in out.stdout


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
    from stalerl.results.report import main as report_main

    # The first `staleness` study's summaries (results commit bf6e677), written by the runtime before the move, are
    # kept as a fixture (m2po, vanilla and no_trust_region) now that the study has been rerun on the current code.
    results = REPO / "tests" / "unit" / "data" / "staleness_schema1"
    assert len(list(results.glob("m2po-*.json"))) == 20  # 4 settings x 5 seeds
    out = tmp_path / "report"
    assert report_main([str(results), "--no-figures", "--out", str(out)]) in (0, None)
    tables = "".join(p.read_text(encoding="utf-8") for p in sorted(out.glob("*.md")))
    assert "m2po" in tables and "5/5" in tables
