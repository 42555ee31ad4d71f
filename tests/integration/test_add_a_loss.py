"""Adding a loss touches one module (issue 37 item 3): a throwaway loss in a temporary package, found through the
``recipe.losses`` entry point, runs through the runtime with its own ``actor.<param>`` key, its metrics reduced by
its declared rules, and a bad value refused before any work, with no file of this repository edited.

The framework lanes run the same loss through each adapter's own code path (tests/integrations/*/test_*plugin*.py);
the guide's own package is built and installed by tests/integration/test_add_a_loss_guide.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import small_overrides
import throwaway_loss

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
CONFIG = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"


@pytest.fixture
def plugin_dir(tmp_path):
    return throwaway_loss.install(tmp_path / "site")


def _python(code: str, plugin_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=throwaway_loss.env_with(plugin_dir),
                          capture_output=True, text=True, timeout=300)


def test_registry_declaration_and_schema_find_the_plugin(plugin_dir):
    code = (
        "import sys, torch\n"
        "from recipe.registry import registered_policy_losses, get_declaration, get_policy_loss_fn\n"
        "from stalerl.config.schema import ActorConfig\n"
        "import dataclasses\n"
        "assert 'throwaway' in registered_policy_losses()\n"
        "f = {x.name: x for x in dataclasses.fields(ActorConfig)}['tl_scale']\n"
        "assert f.default == 1.0 and f.metadata['gt'] == 0.0 and 'scale' in f.metadata['help']\n"
        "torch.manual_seed(0)\n"
        "old, new = torch.randn(3, 5), torch.randn(3, 5)\n"
        "adv, mask = torch.randn(3, 5), torch.rand(3, 5) > 0.3\n"
        "a, _ = get_policy_loss_fn('throwaway')(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,"
        " loss_agg_mode='token-mean', config={'tl_scale': 1.0}, rollout_is_weights=None)\n"
        "b, _ = get_policy_loss_fn('no_trust_region')(old_log_prob=old, log_prob=new, advantages=adv,"
        " response_mask=mask, loss_agg_mode='token-mean', config={}, rollout_is_weights=None)\n"
        "c, _ = get_policy_loss_fn('throwaway')(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,"
        " loss_agg_mode='token-mean', config={'tl_scale': 0.5}, rollout_is_weights=None)\n"
        "assert torch.equal(a, b) and torch.allclose(c, 0.5 * a), (a, b, c)\n"
        "print('ok', get_declaration('throwaway').metrics['throwaway/num_tokens'].combine)\n"
    )
    res = _python(code, plugin_dir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok", "sum"]


def test_runtime_trains_with_the_plugin_loss(plugin_dir, tmp_path):
    assert REPO not in plugin_dir.parents  # the loss lives outside the repository: nothing here is edited
    args = [sys.executable, str(SCRIPT), "--config", str(CONFIG),
            *small_overrides(tmp_path, total_train_steps=2),
            "actor.loss=throwaway", "actor.tl_scale=0.5", "actor.mb_spec.max_tokens_per_mb=64",
            "experiment_name=plugin", "trial_name=t0"]
    res = subprocess.run(args, cwd=REPO, env=throwaway_loss.env_with(plugin_dir), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "plugin" / "t0"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/throwaway/ratio_mean" in r]
    assert len(train) == 2, rows[:2]
    for r in train:
        # split into micro-batches: the count is summed over them (its declared rule), not averaged
        assert r["actor/num_micro_batches"] > 1
        assert r["actor/throwaway/num_tokens"] > 64
    resolved = (run / "config.yaml").read_text() if (run / "config.yaml").exists() else ""
    assert "tl_scale: 0.5" in resolved or not resolved


def test_bad_plugin_value_is_one_line_before_work(plugin_dir, tmp_path):
    args = [sys.executable, str(SCRIPT), "--config", str(CONFIG), *small_overrides(tmp_path),
            "actor.loss=throwaway", "actor.tl_scale=0"]
    res = subprocess.run(args, cwd=REPO, env=throwaway_loss.env_with(plugin_dir), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode != 0
    assert "actor.tl_scale" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not list(tmp_path.rglob("metrics.jsonl"))
