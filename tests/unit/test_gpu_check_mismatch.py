"""scripts/gpu_check_mismatch.py (the GPU check's engine-mismatch control) on CPU with the tiny model: the probe's
comparison and its positive controls on one generated batch, the per-token table behind the figures, and the
entries failing when the engine is broken (its log-probs shifted by one token) or the comparison is blind (it
compares a tensor with itself)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import REPO

_spec = importlib.util.spec_from_file_location("gpu_check_mismatch", REPO / "scripts" / "gpu_check_mismatch.py")
mc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mc)

OVERRIDES = ["actor.dtype=bfloat16", "actor.device=cpu", "torch_threads=1", "train_dataset.batch_size=2",
             "gconfig.n_samples=2", "gconfig.max_new_tokens=8"]


def _by(result, check):
    return next(e for e in result["entries"] if e["check"] == check)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_control_sees_a_bf16_difference_and_the_table_holds_the_figures():
    result = mc.run_control(OVERRIDES)
    assert result["dtype"] == "bfloat16" and result["tokens"] > 0
    assert all(e["passed"] for e in result["entries"]), result["entries"]
    f32 = _by(result, "mismatch_control/float32_rescore")
    assert mc.MISMATCH_CONTROL_MIN <= f32["error"] <= mc.BF16_MISMATCH_MAX
    for name in ("micro_batch", "plain_head"):  # reported, nonzero or not
        assert isinstance(_by(result, f"mismatch_control/{name}")["nonzero"], bool)
    table = result["table"]
    assert table["columns"][:5] == ["row", "position", "token_id", "engine_logp", "trainer_logp"]
    assert len(table["rows"]) == result["tokens"]
    # the figures are the table's: mean |trainer - engine| over its tokens
    d = torch.tensor([r[4] - r[3] for r in table["rows"]], dtype=torch.float64)
    assert float(d.abs().mean()) == pytest.approx(result["engine_vs_trainer"]["mismatch/abs_mean"], rel=1e-6)
    assert all(r[3] <= 0 and r[4] <= 0 for r in table["rows"])


def test_a_broken_engine_fails_the_bound(monkeypatch):
    """An engine whose recorded log-probs are off by one position (a classic bookkeeping bug) is far above the
    bf16 bound."""
    from stalerl.rollout import engine as engine_mod

    real = engine_mod.HFRolloutEngine.generate

    def shifted(self, *a, **kw):
        batch = real(self, *a, **kw)
        batch.behavior_logp = torch.where(batch.response_mask, torch.roll(batch.behavior_logp, 1, dims=1),
                                          batch.behavior_logp)
        return batch

    monkeypatch.setattr(engine_mod.HFRolloutEngine, "generate", shifted)
    result = mc.run_control(OVERRIDES)
    e = _by(result, "mismatch_control/engine_vs_trainer")
    assert not e["passed"] and e["error"] > 3 * mc.BF16_MISMATCH_MAX, e


def test_a_blind_comparison_fails_the_float32_control_and_a_zero_warns(monkeypatch):
    """A probe that compares a tensor with itself reports 0 for everything: the engine's 0 alone would pass, the
    float32 control catches it, and the exact 0 is a warning that says the comparison could NOT see a difference."""
    import stalerl.training.mismatch as mismatch

    real = mismatch.engine_mismatch
    monkeypatch.setattr(mismatch, "engine_mismatch", lambda a, b, mask: real(a, a, mask))
    result = mc.run_control(OVERRIDES)
    assert _by(result, "mismatch_control/engine_vs_trainer")["passed"]  # 0 is within the bound
    f32 = _by(result, "mismatch_control/float32_rescore")
    assert not f32["passed"] and f32["error"] == 0
    (warning,) = result["warnings"]
    assert "exactly 0" in warning and "could NOT see a difference" in warning
