"""A loss from outside cannot break the others (issue 44 items 1, 2, 5), runtime lane: beside the good throwaway plugin
(tests/throwaway_loss.py) sit a plugin that fails to import, one that takes a built-in's name, one that declares the
shared PPO clip's key as its own, one that redeclares another loss's parameter, and one named after a framework's
own loss. Each bad one is refused alone, in one logged line naming it, the clash and the fix; the good one and every
built-in still register, train and keep their defaults.

The framework lanes do the same through each adapter (verl: tests/integration/test_add_a_loss_verl.py; TRL,
ms-swift, AReaL, Trinity: tests/integrations/<framework>/).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import throwaway_loss

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crowded_site(tmp_path_factory) -> Path:
    site = throwaway_loss.install(tmp_path_factory.mktemp("site"))
    throwaway_loss.install_broken(site)
    throwaway_loss.install_clashing(site, "gspo", "verl")
    return site


def _python(code: str, site: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=throwaway_loss.env_with(site),
                          capture_output=True, text=True, timeout=timeout)


def test_each_bad_plugin_is_refused_alone_and_the_rest_register(crowded_site):
    code = (
        "import json, sys\n"
        "from recipe.registry import (BUILTIN_POLICY_LOSSES, get_policy_loss_fn, refusals, registered_policy_losses,"
        " split_flags, usable_declarations)\n"
        "from recipe.declaration import PPO_CLIP\n"
        "from stalerl.config.schema import ActorConfig\n"
        "import dataclasses\n"
        "names = registered_policy_losses()\n"
        "fields = {f.name: f.default for f in dataclasses.fields(ActorConfig)}\n"
        "verl = usable_declarations('verl', own_losses={'gspo'})\n"
        "print(json.dumps({'names': names, 'builtins': list(BUILTIN_POLICY_LOSSES), 'refused': refusals(),"
        " 'eps_clip': fields['eps_clip'], 'm2_threshold': fields['m2_threshold'], 'verl': sorted(verl),"
        " 'gspo_module': get_policy_loss_fn('gspo').__module__, 'tl': get_policy_loss_fn('throwaway').__name__,"
        " 'flags': split_flags()}))\n"
    )
    res = _python(code, crowded_site)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out["builtins"]) | {"throwaway", "gspo"} <= set(out["names"])
    assert not {"clip_thief", "tau_thief"} & set(out["names"])
    refused = out["refused"]
    assert {"broken_import", "name_thief", "clip_thief", "tau_thief", "verl:gspo"} <= set(refused)
    for key, line in refused.items():
        assert "\n" not in line and "Fix:" in line, line
    assert "failed to import" in refused["broken_import"] and "broken on purpose" in refused["broken_import"]
    assert "'m2po' is already declared by built-in recipe.m2po" in refused["name_thief"]
    assert "'eps_clip'" in refused["clip_thief"] and "PPO-clip group" in refused["clip_thief"]
    assert "'m2_threshold'" in refused["tau_thief"] and "'m2po'" in refused["tau_thief"]  # both owners named
    assert "verl has its own loss 'gspo'" in refused["verl:gspo"] and "framework_names" in refused["verl:gspo"]
    # the namespace rule kept every built-in's default: nobody changed vanilla's clip or m2po's tau
    assert out["eps_clip"] == 0.2 and out["m2_threshold"] == 0.04
    assert "gspo" not in out["verl"] and "throwaway" in out["verl"] and "m2po" in out["verl"]
    assert out["gspo_module"] == "clash_gspo_pkg_algorithm"  # loaded on first use from its declaration
    assert out["flags"] == {}  # both good plugin losses passed the registry's split probe on first use
    # the refusals reach the log once each, as one line
    for plugin in ("broken_import", "name_thief", "clip_thief", "tau_thief"):
        assert sum(plugin in line for line in res.stderr.splitlines()) >= 1, res.stderr[-2000:]


def test_the_good_plugin_trains_beside_the_bad_ones(crowded_site, tmp_path):
    from conftest import small_overrides

    script = REPO / "examples" / "math" / "gsm8k_rl.py"
    config = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"
    args = [sys.executable, str(script), "--config", str(config), *small_overrides(tmp_path, total_train_steps=1),
            "actor.loss=throwaway", "actor.tl_scale=0.5", "experiment_name=crowded", "trial_name=t0"]
    res = subprocess.run(args, cwd=REPO, env=throwaway_loss.env_with(crowded_site), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "crowded" / "t0" / "metrics.jsonl").read_text().splitlines()]
    assert any("actor/throwaway/ratio_mean" in r for r in rows)


def test_a_declaration_plugin_keeps_config_time_torch_free(tmp_path):
    """Item 5: with a plugin whose entry point names its declaration module, the registry, the runtime's schema and
    --help import no torch; the algorithm loads on first use."""
    site = tmp_path / "site"
    throwaway_loss.install_clashing(site, "scaled_pg_probe", "none")
    code = ("import sys\n"
            "from recipe.registry import declarations, is_policy_loss_registered\n"
            "from stalerl.config.helptext import format_help\n"
            "assert is_policy_loss_registered('scaled_pg_probe')\n"
            "assert 'actor.cl_scale' in format_help()\n"
            "print('torch' in sys.modules)\n")
    res = _python(code, site)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-1] == "False"
    start = time.perf_counter()
    res = subprocess.run([sys.executable, str(REPO / "examples" / "math" / "gsm8k_rl.py"), "--help"], cwd=REPO,
                         env=throwaway_loss.env_with(site), capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - start
    assert res.returncode == 0 and "cl_scale" in res.stdout, res.stderr[-2000:]
    print(f"--help with a declaration plugin installed: {took:.2f} s (the bound is bench/cli_startup.py's)")
