"""recipe/rollout_correction.py (issue 37 item 4): every mode against its formula on hand-computed tensors and against
a literal per-token loop on random ones, padding ignored, split-invariant by rows, no overflow on long rows, bad
settings refused with one line, and what a rejected token does to a loss's denominator."""

from __future__ import annotations

import math

import pytest
import torch

from recipe.rollout_correction import (METRIC_KEYS, MODES, CorrectionParams, apply_correction, correction_metrics,
                                       correction_weights)


def literal(trainer, engine, mask, mode, threshold=2.0, low=0.5, high=5.0):
    """Row by row, token by token, straight from the definitions (float64 python)."""
    rows, cols = mask.shape
    w = [[0.0] * cols for _ in range(rows)]
    keep = [[False] * cols for _ in range(rows)]
    for i in range(rows):
        idx = [j for j in range(cols) if mask[i, j]]
        logs = {j: float(trainer[i, j]) - float(engine[i, j]) for j in idx}
        total = sum(logs.values())
        row_rho = math.exp(total) if total < 700 else math.inf
        geo = math.exp(total / len(idx)) if idx else 1.0
        for j in idx:
            rho = math.exp(logs[j])
            if mode == "none":
                w[i][j], keep[i][j] = 1.0, True
            elif mode == "tis_token":
                w[i][j], keep[i][j] = min(rho, threshold), True
            elif mode == "tis_seq":
                w[i][j], keep[i][j] = min(row_rho, threshold), True
            elif mode == "rs_token":
                keep[i][j] = low <= rho <= high
                w[i][j] = 1.0 if keep[i][j] else 0.0
            elif mode == "icepop":
                keep[i][j] = low <= rho <= high
                w[i][j] = rho if keep[i][j] else 0.0
            elif mode == "rs_seq":
                keep[i][j] = low <= row_rho <= high
                w[i][j] = 1.0 if keep[i][j] else 0.0
            elif mode == "rs_geo":
                keep[i][j] = low <= geo <= high
                w[i][j] = 1.0 if keep[i][j] else 0.0
    return torch.tensor(w, dtype=torch.float64), torch.tensor(keep)


def _batch(seed, rows=10, cols=24, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(rows, cols, generator=g) * 3
    trainer = engine + torch.randn(rows, cols, generator=g) * scale / math.sqrt(cols) * 4
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    trainer = torch.where(mask, trainer, torch.full_like(trainer, float("nan")))  # garbage on padding
    return trainer, engine, mask


def _close(t: torch.Tensor, expected: list) -> bool:
    return torch.allclose(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-6, atol=1e-7)


def test_every_mode_on_a_hand_computed_batch():
    # row 0: log rho = [ln 3, ln 0.25, 0]; row 1: [ln 1.5, ln 1.5, pad]
    t = torch.tensor([[math.log(3.0), math.log(0.25), 0.0], [math.log(1.5), math.log(1.5), 9.0]])
    e = torch.zeros(2, 3)
    m = torch.tensor([[True, True, True], [True, True, False]])
    w, k = correction_weights(t, e, m, "tis_token")  # min(rho, 2)
    assert _close(w, [[2.0, 0.25, 1.0], [1.5, 1.5, 0.0]]) and k.tolist() == m.tolist()
    w, k = correction_weights(t, e, m, "tis_seq")  # row rho: 0.75 and 2.25 -> min(., 2)
    assert _close(w, [[0.75] * 3, [2.0, 2.0, 0.0]]) and k.tolist() == m.tolist()
    w, k = correction_weights(t, e, m, "rs_token")  # 0.5 <= rho <= 5: 0.25 rejected
    assert k.tolist() == [[True, False, True], [True, True, False]] and w.tolist() == [[1, 0, 1], [1, 1, 0]]
    w, k = correction_weights(t, e, m, "icepop")
    assert k.tolist() == [[True, False, True], [True, True, False]]
    assert _close(w, [[3.0, 0.0, 1.0], [1.5, 1.5, 0.0]])
    _, k = correction_weights(t, e, m, "rs_seq", low=1.0, high=5.0)  # row rho 0.75 rejected, 2.25 kept
    assert k.tolist() == [[False] * 3, [True, True, False]]
    _, k = correction_weights(t, e, m, "rs_geo", low=0.95, high=1.2)  # geo: 0.75^(1/3)=0.909, 1.5
    assert k.tolist() == [[False] * 3, [False] * 3]
    _, k = correction_weights(t, e, m, "rs_geo", low=0.9, high=1.6)
    assert k.tolist() == m.tolist()
    w, k = correction_weights(t, e, m, "none")
    assert w.tolist() == [[1, 1, 1], [1, 1, 0]] and k.tolist() == m.tolist()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_every_mode_matches_a_literal_loop_on_random_batches(mode, seed):
    trainer, engine, mask = _batch(seed)
    low, high = (0.9, 1.1) if mode == "rs_geo" else (0.6, 1.8)  # a row's geometric mean is close to 1
    w, k = correction_weights(trainer, engine, mask, mode, threshold=1.7, low=low, high=high)
    ref_w, ref_k = literal(trainer, engine, mask, mode, threshold=1.7, low=low, high=high)
    assert k.tolist() == ref_k.tolist()
    assert torch.allclose(w.double(), ref_w, rtol=1e-5, atol=1e-7)
    assert not torch.isnan(w).any() and not (w[~mask] != 0).any()
    if mode in ("rs_token", "rs_seq", "rs_geo", "icepop"):
        assert 0 < int(k.sum()) < int(mask.sum()), "the data exercise rejection"


@pytest.mark.parametrize("mode", MODES)
def test_splitting_by_rows_changes_nothing(mode):
    trainer, engine, mask = _batch(7)
    w, k = correction_weights(trainer, engine, mask, mode)
    for a, b in ((0, 3), (3, 4), (4, 10)):
        ws, ks = correction_weights(trainer[a:b], engine[a:b], mask[a:b], mode)
        assert torch.equal(ws, w[a:b]) and torch.equal(ks, k[a:b])


def test_long_rows_never_overflow():
    t = torch.full((2, 4000), 0.5)  # sum of log rho = 2000: exp() would be inf
    e = torch.zeros(2, 4000)
    m = torch.ones(2, 4000, dtype=torch.bool)
    w, _ = correction_weights(t, e, m, "tis_seq", threshold=2.0)
    assert torch.allclose(w, torch.full_like(w, 2.0))
    _, k = correction_weights(t, e, m, "rs_seq")
    assert not k.any()
    _, k = correction_weights(-t, e, m, "rs_seq", low=0.0, high=5.0)  # rho underflows to 0, low 0 keeps it
    assert k.all()


@pytest.mark.parametrize("kwargs, key", [({"mode": "tis"}, "rollout_correction.mode"),
                                          ({"mode": "tis_token", "threshold": 0.0}, "rollout_correction.threshold"),
                                          ({"mode": "rs_token", "low": 2.0, "high": 1.0}, "rollout_correction.low"),
                                          ({"mode": "rs_token", "high": math.inf}, "rollout_correction.low")])
def test_bad_settings_are_refused_with_one_line(kwargs, key):
    with pytest.raises(ValueError) as exc:
        CorrectionParams(**kwargs)
    msg = str(exc.value)
    assert key in msg and "Fix:" in msg and "\n" not in msg


def test_metrics_on_a_hand_computed_batch():
    t = torch.tensor([[math.log(3.0), math.log(0.25), 0.0]])
    e = torch.zeros(1, 3)
    m = torch.ones(1, 3, dtype=torch.bool)
    w, k = correction_weights(t, e, m, "icepop")
    got = correction_metrics(t, e, m, w, k)
    assert list(got) == list(METRIC_KEYS)
    assert got["rollout_correction/rejected_fraction"] == pytest.approx(1 / 3)
    assert got["rollout_correction/weight_mean"] == pytest.approx(2.0)  # (3 + 1) / 2 kept
    assert got["rollout_correction/weight_max"] == pytest.approx(3.0)
    assert got["rollout_correction/kl_k1"] == pytest.approx(-(math.log(3) + math.log(0.25)) / 3)
    k3 = sum(r - 1 - math.log(r) for r in (3.0, 0.25, 1.0)) / 3
    assert got["rollout_correction/kl_k3"] == pytest.approx(k3)


def test_mode_none_is_a_no_op_and_a_mode_without_engine_logprobs_is_refused():
    trainer, engine, mask = _batch(3)
    weights, loss_mask, metrics = apply_correction(trainer, engine, mask, CorrectionParams())
    assert weights is None and loss_mask is mask and metrics == {}
    with pytest.raises(ValueError, match="actor.behavior_logp=recompute"):
        apply_correction(trainer, None, mask, CorrectionParams("tis_token"))


def test_a_rejected_token_leaves_the_denominator():
    """token-mean: the loss over the kept tokens divided by the kept count (not by all valid tokens); seq-mean-*: a row
    with every token rejected is no longer a row of the step."""
    from recipe.registry import get_policy_loss_fn

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g)
    lp = old + 0.05 * torch.randn(3, 5, generator=g)
    adv = torch.tensor([[1.0] * 5, [-0.5] * 5, [2.0] * 5])
    mask = torch.ones(3, 5, dtype=torch.bool)
    engine = old.clone()
    engine[0, :2] -= 2.0  # rho = e^2 > 5: rejected by rs_token
    engine[2] += 3.0  # the whole row 2: rho = e^-3 < 0.5
    weights, keep, _ = apply_correction(old, engine, mask, CorrectionParams("rs_token"))
    assert int(keep.sum()) == 15 - 2 - 5
    vanilla = get_policy_loss_fn("vanilla")
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, _ = vanilla(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=keep, loss_agg_mode=agg,
                          config={}, rollout_is_weights=weights)
        ref, _ = vanilla(old_log_prob=old[:2], log_prob=lp[:2], advantages=adv[:2], response_mask=keep[:2],
                         loss_agg_mode=agg, config={})
        if agg == "token-mean":  # the kept tokens only, divided by their count
            per_token = -adv * torch.exp(lp - old)
            assert float(loss) == pytest.approx(float(per_token[keep].sum() / keep.sum()), rel=1e-6)
        else:  # row 2 rejected entirely: the step is rows 0 and 1
            assert float(loss) == pytest.approx(float(ref), rel=1e-6)


def test_the_runtime_config_offers_exactly_the_recipes_modes_and_defaults():
    import dataclasses

    from recipe.rollout_correction import DEFAULT_HIGH, DEFAULT_LOW, DEFAULT_THRESHOLD
    from stalerl.config import load_config
    from stalerl.config.schema import RolloutCorrectionConfig

    field = {f.name: f for f in dataclasses.fields(RolloutCorrectionConfig)}["mode"]
    assert tuple(field.metadata["choices"]) == MODES
    rc = load_config([]).rollout_correction
    assert (rc.mode, rc.threshold, rc.low, rc.high) == ("none", DEFAULT_THRESHOLD, DEFAULT_LOW, DEFAULT_HIGH)


def test_a_correction_without_the_recompute_is_refused_before_any_work():
    from stalerl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as exc:
        load_config(["rollout_correction.mode=rs_token"])
    assert "actor.behavior_logp=recompute" in str(exc.value)
    assert load_config(["rollout_correction.mode=rs_token", "actor.behavior_logp=recompute"])
