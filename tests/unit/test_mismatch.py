"""The engine-mismatch metric (stalerl.training.mismatch, stats_logger.mismatch_freq_steps): the fast functions
against literal loops on random inputs, and a synchronous run whose trained metrics are bit-identical with and
without the probe (it draws no random number and takes no gradient)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import small_overrides
from stalerl.training.mismatch import engine_mismatch, fresh_rows


def _reference(trainer, engine, mask):
    ds = [float(trainer[i, j]) - float(engine[i, j]) for i in range(mask.shape[0]) for j in range(mask.shape[1])
          if bool(mask[i, j])]
    if not ds:
        return {}
    srt = sorted(abs(d) for d in ds)
    pos = 0.99 * (len(srt) - 1)
    lo = math.floor(pos)
    p99 = srt[lo] + (srt[min(lo + 1, len(srt) - 1)] - srt[lo]) * (pos - lo)
    return {"mismatch/abs_mean": sum(abs(d) for d in ds) / len(ds), "mismatch/m2": sum(d * d for d in ds) / len(ds),
            "mismatch/max_abs": max(abs(d) for d in ds), "mismatch/tokens": float(len(ds)),
            "mismatch/mean": sum(ds) / len(ds), "mismatch/abs_p99": p99,
            "mismatch/frac_gt_0.1": sum(abs(d) > 0.1 for d in ds) / len(ds)}


@pytest.mark.parametrize("seed", range(5))
def test_engine_mismatch_equals_the_literal_loop(seed):
    g = torch.Generator().manual_seed(seed)
    rows, steps = 3 + seed, 7
    trainer = -torch.rand(rows, steps, generator=g) * 5
    engine = trainer + 0.08 * torch.randn(rows, steps, generator=g)  # some |d| > 0.1, most below
    mask = torch.rand(rows, steps, generator=g) > 0.3
    got, want = engine_mismatch(trainer, engine, mask), _reference(trainer, engine, mask)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-12), k
    assert got["mismatch/m2"] > 0


def test_engine_mismatch_is_empty_without_tokens_and_zero_for_equal_logprobs():
    x = torch.randn(2, 4)
    assert engine_mismatch(x, x + 1, torch.zeros(2, 4, dtype=torch.bool)) == {}
    same = engine_mismatch(x, x.clone(), torch.ones(2, 4, dtype=torch.bool))
    assert same["mismatch/abs_mean"] == 0 and same["mismatch/m2"] == 0 and same["mismatch/tokens"] == 8


@pytest.mark.parametrize("seed", range(5))
def test_fresh_rows_equals_the_literal_loop(seed):
    g = torch.Generator().manual_seed(seed)
    versions = torch.randint(0, 3, (8, 5), generator=g)
    mask = torch.rand(8, 5, generator=g) > 0.4
    versions = torch.where(mask, versions, torch.full_like(versions, -1))
    for v in range(3):
        want = [i for i in range(8) if mask[i].any() and all(int(versions[i, j]) == v for j in range(5) if mask[i, j])]
        assert fresh_rows(versions, mask, v) == want


def _sync_run(tmp_path, trial, freq):
    from stalerl.config import load_config, run_dir
    from stalerl.results.metrics_log import read_metrics
    from stalerl.training.trainer import Trainer

    over = small_overrides(tmp_path, **{"trial_name": trial, "rollout.fixed_staleness": 1, "total_train_steps": 4,
                                        "evaluator.freq_steps": 2, "saver.save_final": False,
                                        "stats_logger.mismatch_freq_steps": freq})
    cfg = load_config(over)
    Trainer(cfg, log=lambda *a, **k: None).train()
    return read_metrics(run_dir(cfg))


def test_probe_leaves_the_trained_metrics_bit_identical(tmp_path):
    without = _sync_run(tmp_path, "off", "null")
    probed = _sync_run(tmp_path, "on", 1)
    assert [r["step"] for r in without] == [r["step"] for r in probed] == [0, 1, 2, 3, 4]
    new_keys = {"mismatch/abs_mean", "mismatch/m2", "mismatch/max_abs", "mismatch/tokens", "timing/mismatch_probe_s"}
    for a, b in zip(without, probed):
        assert not any(k.startswith("mismatch/") for k in a)
        same = {k for k in a if not k.startswith(("timing/", "throughput/", "memory/")) and not k.endswith("seconds")}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}, a["step"]  # exactly, not approximately
        if a["step"] > 0:
            assert new_keys <= b.keys()
            # the HF engine and the trainer compute the same fp32 forward (KV cache vs full pass): tiny mismatch
            assert 0 <= b["mismatch/abs_mean"] < 1e-4 and b["mismatch/m2"] <= b["mismatch/max_abs"] ** 2
            assert b["mismatch/tokens"] > 0 and math.isfinite(b["mismatch/m2"])


def test_probe_is_off_with_recompute_and_when_null(tmp_path):
    from stalerl.config import load_config
    from stalerl.training.trainer import Trainer

    for over in ({"actor.behavior_logp": "recompute"}, {"stats_logger.mismatch_freq_steps": "null"}):
        cfg = load_config(small_overrides(tmp_path, **over))
        t = Trainer(cfg, log=lambda *a, **k: None)
        assert not t.probe.due(t.step)
    t = Trainer(load_config(small_overrides(tmp_path, **{"stats_logger.mismatch_freq_steps": 3})),
                log=lambda *a, **k: None)
    assert [t.probe.due(step) for step in range(7)] == [True, False, False, True, False, False, True]
