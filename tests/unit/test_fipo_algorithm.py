"""recipe.fipo: the Future-KL scan, influence weights, sequence drop, the loss and its gradient, config, metrics,
split invariance. The vectorised code is compared with two literal references (tests/unit/fipo_reference.py): the
reference implementation's chunked matmul and a per-row per-token loop, on thousands of seeded cases."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fipo_reference import fipo_loop, future_kl_chunked  # noqa: E402

from recipe.baselines import compute_policy_loss_vanilla  # noqa: E402
from recipe.fipo import (  # noqa: E402
    METRIC_KEYS,
    FIPOParams,
    compute_policy_loss_fipo,
    discounted_future_sum,
    fipo_params_from_config,
    fipo_weights,
)
from recipe.registry import get_policy_loss_fn  # noqa: E402

LN10 = float(torch.tensor(math.log(10.0), dtype=torch.float32))


def call(old, new, adv, mask, agg="token-mean", **cfg):
    return compute_policy_loss_fipo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                    loss_agg_mode=agg, config=cfg)


def rowwise(adv_rows, width):
    return torch.tensor(adv_rows, dtype=torch.float32).unsqueeze(1).expand(len(adv_rows), width).clone()


# ------------------------------------------------------------------------------------------- Future-KL scan


@pytest.mark.parametrize("t", [1, 2, 5, 63, 64, 65, 129, 1000, 4097])
@pytest.mark.parametrize("decay", [32.0, 1.0, 0.05, 1e6])
def test_scan_equals_chunked_matmul_for_any_chunk(t, decay):
    g = torch.Generator().manual_seed(t * 7 + int(decay * 10) % 97)
    x = torch.randn(3, t, generator=g, dtype=torch.float64) * 2
    x[0, t // 2:] = 0.0  # padding tail
    gamma = 2.0 ** (-1.0 / decay)
    fast = discounted_future_sum(x.float(), gamma)
    assert fast.dtype == torch.float32 and not fast.requires_grad
    scale = float(x.abs().max()) / (1 - gamma + 1e-12) if gamma < 1 else float(x.abs().sum())
    for chunk in sorted({1, 7, 64, 128, t}):
        ref = future_kl_chunked(x, gamma, chunk)
        torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-6 * max(1.0, scale))
    for block in (2, 3, 17, 64, 256):  # the scan's own block length changes nothing either
        torch.testing.assert_close(discounted_future_sum(x.float(), gamma, block=block), fast, rtol=1e-5,
                                   atol=1e-6 * max(1.0, scale))


def test_scan_is_the_reverse_recurrence_and_never_overflows():
    t = 20480
    gamma = 2.0 ** (-1.0 / 32)
    x = torch.full((2, t), 20.0)
    x[1, 10000:] = 0.0
    out = discounted_future_sum(x, gamma)
    assert torch.isfinite(out).all()
    k = torch.arange(t, dtype=torch.float64)
    closed0 = 20.0 * (1 - gamma ** (t - k)) / (1 - gamma)  # geometric series, computed safely in fp64
    torch.testing.assert_close(out[0].double(), closed0, rtol=2e-5, atol=1e-3)
    assert torch.all(out[1, 10000:] == 0)
    # the closed form the module avoids does overflow here
    assert not torch.isfinite(torch.tensor(gamma, dtype=torch.float32) ** -torch.arange(t, dtype=torch.float32)).all()


def test_scan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gamma"):
        discounted_future_sum(torch.zeros(1, 3), 1.5)
    with pytest.raises(ValueError, match="block"):
        discounted_future_sum(torch.zeros(1, 3), 0.5, block=1)


def test_future_kl_counts_positions_skips_masked_and_filtered_tokens():
    gamma = 2.0 ** (-1.0 / 2.0)
    old = torch.zeros(1, 5)
    new = torch.tensor([[0.1, 9.0, 0.3, 3.0, -0.5]])
    mask = torch.tensor([[True, False, True, True, True]])  # position 1 masked (a tool span): adds nothing
    fw = fipo_weights(new - old, torch.ones(1, 5), mask, FIPOParams(decay_rate=2.0))
    # position 3 has d = 3 > ln 10: left out of every sum, but still counts in the distance
    expect0 = 0.1 + gamma ** 2 * 0.3 + gamma ** 4 * (-0.5)
    expect3 = gamma * (-0.5)
    assert fw.future_kl[0, 0].item() == pytest.approx(expect0, rel=1e-6)
    assert fw.future_kl[0, 3].item() == pytest.approx(expect3, rel=1e-6)


# ------------------------------------------------------------------------- against the loop reference


def _case(g: torch.Generator):
    bsz = int(torch.randint(1, 5, (1,), generator=g))
    width = int(torch.randint(0, 11, (1,), generator=g))
    lens = torch.randint(0, width + 1, (bsz,), generator=g)
    mask = torch.arange(width)[None, :] < lens[:, None]
    if width and torch.rand(1, generator=g) < 0.3:  # holes in the middle (tool-masked spans)
        mask &= torch.rand(bsz, width, generator=g) > 0.25
    old = -torch.rand(bsz, width, generator=g) * 3 - 0.01
    scale = [0.0, 0.05, 0.5, 2.0, 6.0][int(torch.randint(0, 5, (1,), generator=g))]
    new = old + torch.randn(bsz, width, generator=g) * scale
    if width and torch.rand(1, generator=g) < 0.5:  # ties at c and clear low-clip tokens
        pick = torch.rand(bsz, width, generator=g)
        old = torch.where(pick < 0.15, torch.zeros_like(old), old)
        new = torch.where(pick < 0.15, torch.full_like(new, LN10), new)  # d == fp32(ln 10) exactly
        new = torch.where((pick >= 0.15) & (pick < 0.3), old + 4.0, new)
    adv_choices = torch.tensor([-1.0, 0.0, 1.0, -0.7, 1.3])
    adv_rows = adv_choices[torch.randint(0, 5, (bsz,), generator=g)]
    if torch.rand(1, generator=g) < 0.3:
        adv_rows = torch.randn(bsz, generator=g)
    adv = adv_rows.unsqueeze(1).expand(bsz, width).clone()
    # garbage on padding must not matter
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    return old, new, adv, mask


MODES = [dict(eps_f=0.2, high_only=True), dict(eps_f=0.2, high_only=False), dict(eps_f=0.0, high_only=True),
         dict(eps_f=0.5, high_only=False)]


def test_vectorised_equals_the_loop_reference_on_thousands_of_cases():
    g = torch.Generator().manual_seed(2603)
    n_cases, seen = 2400, {"drop": 0, "keep1": 0, "reset": 0, "tie": 0, "empty_row": 0, "zero_adv": 0}
    for i in range(n_cases):
        old, new, adv, mask = _case(g)
        mode = MODES[i % len(MODES)]
        safety = [10.0, 3.0, 1.5, 1e9][(i // 4) % 4]  # 1e9 > e^20: the reset never fires
        c = [10.0, 10.0, 3.0][(i // 16) % 3]
        decay = [32.0, 2.0, 0.5][(i // 48) % 3]
        eps_high = [0.2, 0.28][(i // 144) % 2]
        cfg = dict(fipo_decay_rate=decay, fipo_clip_ratio_c=c, fipo_influence_clip_ratio=mode["eps_f"],
                   fipo_influence_clip_high_only=mode["high_only"], fipo_safety_threshold=safety,
                   clip_ratio_low=0.2, clip_ratio_high=eps_high)
        ref_loss, ref_w, ref_kept, ref_m = fipo_loop(old, new, adv, mask, decay_rate=decay, c=c, eps_f=mode["eps_f"],
                                                     high_only=mode["high_only"], safety=safety, eps_low=0.2,
                                                     eps_high=eps_high)
        lp = new.clone().requires_grad_(True)
        loss, metrics = call(old, lp, adv, mask, **cfg)
        assert math.isfinite(loss.item())
        assert loss.item() == pytest.approx(ref_loss, rel=2e-5, abs=2e-6), i
        params = fipo_params_from_config(cfg)
        fw = fipo_weights(torch.where(mask, new - torch.where(mask, old, 0.0), 0.0), adv, mask, params)
        if mask.numel():
            w_ref = torch.tensor(ref_w, dtype=torch.float64)
            torch.testing.assert_close(torch.where(mask, fw.weights.double(), 1.0),
                                       torch.where(mask, w_ref, 1.0), rtol=2e-5, atol=2e-6)
        assert (~fw.dropped_rows).tolist() == ref_kept, i
        assert set(metrics) == set(METRIC_KEYS)
        assert metrics["fipo/sequence_drop_ratio"] == pytest.approx(ref_m["fipo/sequence_drop_ratio"], rel=1e-6)
        assert metrics["fipo/influence_weights_mean_raw"] == pytest.approx(ref_m["fipo/influence_weights_mean_raw"],
                                                                           rel=1e-4)
        for key in ("fipo/influence_weight_clip_ratio_upper", "fipo/influence_weight_clip_ratio_lower"):
            assert metrics[key] == pytest.approx(ref_m[key], abs=1e-6), (i, key)
        d = torch.where(mask, new - torch.where(mask, old, 0.0), 0.0)
        neg = adv < 0
        seen["drop"] += int(fw.dropped_rows.sum())
        seen["keep1"] += int((((d > math.log(c)) & mask & neg).sum(1) == 1).sum())
        seen["reset"] += int((mask & neg & (d > math.log(safety))).sum())
        seen["tie"] += int((mask & (d == LN10)).sum())
        seen["empty_row"] += int((mask.sum(1) == 0).sum())
        seen["zero_adv"] += int((mask & (adv == 0)).any(1).sum())
    assert all(v > 20 for v in seen.values()), seen  # every edge case was exercised, many times


# --------------------------------------------------------------------------------------- ratio == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ratio_one_gives_unit_weights_and_the_plain_clipped_pg_loss(mode, agg):
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 9, generator=g) * 2
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [4], [0], [7]])
    adv = rowwise([1.0, -0.5, 2.0, -2.0], 9)
    cfg = dict(fipo_influence_clip_ratio=mode["eps_f"], fipo_influence_clip_high_only=mode["high_only"],
               clip_ratio_c=10.0)
    lp = old.clone().requires_grad_(True)
    loss, metrics = call(old, lp, adv, mask, agg, **cfg)
    loss.backward()
    fw = fipo_weights(torch.zeros_like(old), adv, mask, fipo_params_from_config(cfg))
    assert torch.all(fw.weights == 1.0) and torch.equal(fw.loss_mask, mask)
    assert metrics["fipo/sequence_drop_ratio"] == 0.0
    assert metrics["fipo/influence_weights_mean_raw"] == 1.0
    # the plain clipped PG (vanilla, dual clip at the same c): loss and gradient identical
    lp2 = old.clone().requires_grad_(True)
    ref, _ = compute_policy_loss_vanilla(old_log_prob=old, log_prob=lp2, advantages=adv, response_mask=mask,
                                         loss_agg_mode=agg, config={"clip_ratio": 0.2, "clip_ratio_c": 10.0})
    ref.backward()
    assert torch.equal(loss.detach(), ref.detach())
    assert torch.equal(lp.grad, lp2.grad)
    if agg == "token-mean":  # -mean(A) over valid tokens, gradient -A/N
        n = int(mask.sum())
        assert loss.item() == pytest.approx(-(adv[mask]).sum().item() / n, rel=1e-6)
        torch.testing.assert_close(lp.grad, torch.where(mask, -adv / n, 0.0))
    if mode["high_only"] and mode["eps_f"] > 0:
        assert metrics["fipo/influence_weight_clip_ratio_lower"] == 1.0  # at the lower bound 1, as documented


# ----------------------------------------------------------------------------------------------- gradient


def test_gradient_is_minus_a_w_r_over_n_on_unclipped_tokens_and_none_through_the_weights():
    g = torch.Generator().manual_seed(11)
    bsz, width = 6, 40
    old = -torch.rand(bsz, width, generator=g) * 2
    new = old + torch.randn(bsz, width, generator=g) * 0.3
    new[1, 5] = old[1, 5] + 3.0  # one low-clip token in an A < 0 row: kept, its own gradient zero
    mask = torch.arange(width)[None, :] < torch.tensor([[40], [31], [17], [40], [0], [25]])
    adv = rowwise([1.0, -1.0, 0.5, -2.0, 1.0, 0.0], width)
    cfg = dict(fipo_decay_rate=4.0, fipo_influence_clip_ratio=0.2, fipo_influence_clip_high_only=False,
               clip_ratio_low=0.2, clip_ratio_high=0.28)
    lp = new.clone().requires_grad_(True)
    loss, _ = call(old, lp, adv, mask, **cfg)
    loss.backward()
    params = fipo_params_from_config(cfg)
    d = torch.where(mask, new - old, 0.0)
    fw = fipo_weights(d, adv, mask, params)
    assert not fw.weights.requires_grad and not fw.future_kl.requires_grad
    assert 0 < (fw.weights != 1).sum() and fw.weights.min() < 1 < fw.weights.max()  # weights are active
    r = torch.exp(d)
    n = int(fw.loss_mask.sum())
    unclipped = fw.loss_mask & (((adv > 0) & (r < 1 + 0.28)) | ((adv < 0) & (r > 1 - 0.2) & (r < 10.0)))
    clipped = fw.loss_mask & (((adv > 0) & (r > 1 + 0.28)) | ((adv < 0) & ((r < 1 - 0.2) | (r > 10.0))))
    assert unclipped.sum() > 50 and clipped.sum() > 3
    expect = -adv * fw.weights * r / n
    torch.testing.assert_close(lp.grad[unclipped], expect[unclipped], rtol=1e-5, atol=1e-8)
    assert torch.all(lp.grad[clipped] == 0)
    assert lp.grad[1, 5] == 0
    assert torch.all(lp.grad[~mask] == 0)


def test_rollout_is_weights_multiply_the_per_token_loss():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(2, 6, generator=g)
    new = old + torch.randn(2, 6, generator=g) * 0.1
    mask = torch.ones(2, 6, dtype=torch.bool)
    adv = rowwise([1.0, -1.0], 6)
    base, _ = call(old, new, adv, mask)
    scaled, _ = compute_policy_loss_fipo(old, new, adv, mask, "token-mean", None, torch.full((2, 6), 0.5))
    assert scaled.item() == pytest.approx(0.5 * base.item(), rel=1e-6)


# ---------------------------------------------------------------------------------------- edge cases


def _drop_case(n_low: int, adv_value: float, tie: bool = False):
    width = 8
    old = torch.zeros(1, width)
    new = torch.full((1, width), 0.05)
    for k in range(n_low):
        new[0, 2 + k] = 3.0  # r = e^3 > 10
    if tie:
        new[0, 6] = LN10  # exactly at c: not a low-clip token
    return old, new, rowwise([adv_value], width), torch.ones(1, width, dtype=torch.bool)


@pytest.mark.parametrize("n_low, adv_value, tie, dropped", [
    (0, -1.0, False, False), (1, -1.0, False, False), (2, -1.0, False, True), (3, -1.0, False, True),
    (1, -1.0, True, False), (2, 1.0, False, False), (2, 0.0, False, False)])
def test_sequence_drop_rule(n_low, adv_value, tie, dropped):
    old, new, adv, mask = _drop_case(n_low, adv_value, tie)
    fw = fipo_weights(new - old, adv, mask, FIPOParams())
    assert bool(fw.dropped_rows[0]) is dropped
    assert torch.equal(fw.loss_mask, mask & ~torch.tensor([[dropped]]))
    lp = new.clone().requires_grad_(True)
    loss, metrics = call(old, lp, adv, mask)
    loss.backward()
    assert metrics["fipo/sequence_drop_ratio"] == float(dropped)
    if dropped:
        assert loss.item() == 0.0 and torch.all(lp.grad == 0)


def test_participation_filter_is_inclusive_at_c():
    old, new, adv, mask = _drop_case(0, 1.0, tie=True)
    fw = fipo_weights(new - old, adv, mask, FIPOParams(decay_rate=1e9))  # gamma ~ 1: F_0 = sum of participants
    assert fw.future_kl[0, 0].item() == pytest.approx(0.05 * 7 + LN10, rel=1e-5)
    old2, new2, adv2, mask2 = _drop_case(1, 1.0)
    fw2 = fipo_weights(new2 - old2, adv2, mask2, FIPOParams(decay_rate=1e9))
    assert fw2.future_kl[0, 0].item() == pytest.approx(0.05 * 7, rel=1e-5)  # the r > c token is left out


@pytest.mark.parametrize("high_only, eps_f, expected", [(True, 0.2, 1.0), (False, 0.2, 1.0), (True, 0.0, 1.0)])
def test_safety_reset(high_only, eps_f, expected):
    # A < 0 and r = e^2.2 ~ 9 > 3: the weight is clamped into [0.8, 1]; with a large positive future, to 1.0
    old = torch.zeros(1, 6)
    new = torch.tensor([[2.2, 2.2, 2.2, 2.2, 2.2, 2.2]])
    adv = rowwise([-1.0], 6)
    mask = torch.ones(1, 6, dtype=torch.bool)
    on = fipo_weights(new - old, adv, mask, FIPOParams(influence_clip_ratio=eps_f, influence_clip_high_only=high_only,
                                                       safety_threshold=3.0))
    off = fipo_weights(new - old, adv, mask, FIPOParams(influence_clip_ratio=eps_f, influence_clip_high_only=high_only,
                                                        safety_threshold=1e9))
    assert torch.all(on.weights == expected)
    assert torch.equal(off.weights, torch.exp(off.future_kl).clamp(max=1.0 + eps_f if eps_f else 10.0))
    assert off.weights.min() > 1.0 + eps_f - 1e-6
    # a small weight is raised to 0.8 in the eps_f = 0 mode (as the reference code does)
    low = fipo_weights(torch.tensor([[2.2, -9.0, -9.0]]), rowwise([-1.0], 3), torch.ones(1, 3, dtype=torch.bool),
                       FIPOParams(influence_clip_ratio=0.0, safety_threshold=3.0))
    assert low.weights[0, 0].item() == pytest.approx(0.8)
    assert low.weights[0, 1].item() == pytest.approx(math.exp(-9.0 - 9.0 * 2 ** (-1 / 32)), rel=1e-4)


def test_clip_bounds_in_every_mode():
    g = torch.Generator().manual_seed(9)
    d = torch.randn(8, 50, generator=g) * 1.5
    mask = torch.ones(8, 50, dtype=torch.bool)
    adv = rowwise([1.0] * 8, 50)
    for params, lo, hi in [(FIPOParams(), 1.0, 1.2), (FIPOParams(influence_clip_high_only=False), 0.8, 1.2),
                           (FIPOParams(influence_clip_ratio=0.0), 0.0, 10.0)]:
        fw = fipo_weights(d, adv, mask, params)
        assert fw.weights.min() >= lo and fw.weights.max() <= hi
        assert fw.metrics["fipo/influence_weight_clip_ratio_upper"] > 0.01
        if lo > 0:
            assert fw.metrics["fipo/influence_weight_clip_ratio_lower"] > 0.05
        else:
            assert fw.metrics["fipo/influence_weight_clip_ratio_lower"] == 0.0  # no lower bound
            assert fw.weights.min() < 0.5


def test_raw_mean_metric_stays_finite_when_exp_overflows():
    t = 400
    old = torch.zeros(1, t)
    new = torch.full((1, t), 19.0)
    loss, metrics = call(old, new, rowwise([1.0], t), torch.ones(1, t, dtype=torch.bool), fipo_clip_ratio_c=1e9)
    assert math.isfinite(metrics["fipo/influence_weights_mean_raw"])
    assert metrics["fipo/influence_weights_mean_raw"] == pytest.approx(
        (399 * math.exp(20.0) + math.exp(19.0)) / 400, rel=1e-4)  # only the last token's F (19) is below 20
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("shape", [(0, 0), (3, 0), (0, 5), (2, 5)])
def test_empty_batches_give_a_finite_zero_loss(shape):
    old = torch.zeros(shape)
    lp = torch.zeros(shape, requires_grad=True)
    loss, metrics = call(old, lp, torch.zeros(shape), torch.zeros(shape, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in metrics.values())
    assert set(metrics) == set(METRIC_KEYS)


# ------------------------------------------------------------------------------------ split invariance


def _split_case(seed=21):
    g = torch.Generator().manual_seed(seed)
    bsz, width = 8, 30
    old = -torch.rand(bsz, width, generator=g) * 2
    new = old + torch.randn(bsz, width, generator=g) * 0.6
    new[2, 3] = old[2, 3] + 4.0
    new[2, 9] = old[2, 9] + 4.0  # row 2 (A < 0) is dropped
    lens = torch.tensor([30, 12, 25, 5, 0, 30, 18, 9])
    mask = torch.arange(width)[None, :] < lens[:, None]
    adv = rowwise([1.0, 0.5, -1.0, -0.3, 1.0, -2.0, 0.0, 1.5], width)
    return old, new, adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_row_splits_with_global_batch_info_give_exactly_the_whole_batch_update(agg):
    """The weights and the Future-KL are per row, so splitting a mini-batch by rows into micro-batches (each padded
    to its own width) and summing with one set of global counts is the one call with those counts, where no row
    drops (c = 100 > e^4: the case's drop is off). With the drop on, the caller's all-valid counts cannot be exact
    for a split: the micro-batch holding the dropped row is refused (next test: the plan makes it exact)."""
    old, new, adv, mask = _split_case()
    info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0]}
    cfg = {"global_batch_info": info, "fipo_clip_ratio_c": 100.0}
    whole_lp = new.clone().requires_grad_(True)
    whole, m_whole = compute_policy_loss_fipo(old, whole_lp, adv, mask, agg, cfg)
    whole.backward()
    assert m_whole["fipo/sequence_drop_ratio"] == 0
    for split in ([[0, 1, 2], [3, 4], [5, 6, 7]], [[i] for i in range(8)]):
        lp = new.clone().requires_grad_(True)
        total = 0.0
        for rows in split:
            w = max(1, int(mask[rows].sum(1).max()))
            loss, _ = compute_policy_loss_fipo(old[rows, :w], lp[rows, :w], adv[rows, :w], mask[rows, :w], agg, cfg)
            loss.backward()
            total = total + loss.detach()
        torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lp.grad, whole_lp.grad, rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="cannot be exact"):
        compute_policy_loss_fipo(old[:3], new[:3], adv[:3], mask[:3], agg, {"global_batch_info": info})


def _one_row_drops():
    """A batch where one of 8 rows drops (its 25 tokens): the registry FIPO on the whole batch, one call."""
    old, new, adv, mask = _split_case()
    ref_loss, _, kept, _ = fipo_loop(old, new, adv, mask)
    assert kept.count(False) == 1
    return old, new, adv, mask, ref_loss


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"])
def test_the_step_as_one_call_with_its_own_counts_is_the_one_call_reference(agg):
    """Issue 37 item 2: told by verl's convention that the step is exactly this call (dp_size 1, batch_num_tokens =
    its valid tokens, global_batch_size = its rows), the registry FIPO divides by the tokens (rows) kept after the
    drop: bit-identical to the call without counts (the reference), not the all-valid count (-0.666 vs -0.869 style:
    x kept / valid)."""
    old, new, adv, mask, ref_loss = _one_row_drops()
    n_valid, n_rows = int(mask.sum()), int(mask.any(-1).sum())  # 7 rows with tokens (row 4 has none)
    lp_ref = new.clone().requires_grad_(True)
    reference, m_ref = call(old, lp_ref, adv, mask, agg)
    reference.backward()
    for counts in ({"batch_num_tokens": n_valid, "global_batch_size": n_rows},
                   {"batch_num_tokens": torch.tensor(n_valid), "global_batch_size": torch.tensor(n_rows)}):
        lp = new.clone().requires_grad_(True)
        loss, metrics = call(old, lp, adv, mask, agg, global_batch_info={"dp_size": 1, **counts})
        loss.backward()
        assert torch.equal(loss.detach(), reference.detach()) and torch.equal(lp.grad, lp_ref.grad)
        assert metrics == m_ref
    # a caller that counted the call's kept tokens (rows) itself: exact as given
    kept = {"batch_num_tokens": n_valid - 25, "global_batch_size": n_rows - 1}
    loss, _ = call(old, new, adv, mask, agg, global_batch_info={"dp_size": 1, **kept})
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=1e-6, atol=1e-8)
    # verl counts every row of the step (8, the empty one included, as verl's own losses do): the dropped row
    # leaves that count too
    loss, _ = call(old, new, adv, mask, agg, global_batch_info={"dp_size": 1, "batch_num_tokens": n_valid,
                                                                "global_batch_size": mask.shape[0]})
    expected = reference if agg == "token-mean" else reference * (n_rows - 1) / (mask.shape[0] - 1)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=1e-8)
    if agg == "token-mean":
        assert reference.item() == pytest.approx(ref_loss, rel=1e-5)
        as_given = ref_loss * (n_valid - 25) / n_valid  # what the all-valid count would have given
        assert abs(reference.item() - as_given) > 0.05 * abs(ref_loss)


@pytest.mark.parametrize("agg, key, count", [
    ("token-mean", "batch_num_tokens", 1000), ("token-mean", "batch_num_tokens", 5),
    ("seq-mean-token-mean", "global_batch_size", 16), ("seq-mean-token-sum", "global_batch_size", 16)])
@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_count_it_cannot_be_exact_with_is_refused_where_a_row_drops(agg, key, count, dp_size):
    """Another count (a larger step, another rank's share) with a dropped row: one line, naming the planner."""
    old, new, adv, mask, _ = _one_row_drops()
    info = {"dp_size": dp_size, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0], key: count}
    with pytest.raises(ValueError) as info_:
        call(old, new, adv, mask, agg, global_batch_info=info)
    message = str(info_.value)
    assert "\n" not in message and f"{key}={count}" in message and "cannot be exact" in message
    assert "recipe.optimizer_batch.plan_optimizer_batch" in message and "row_keep_mask" in message
    # the same call's own count on two ranks is a share of a larger step: refused too
    if dp_size == 2:
        with pytest.raises(ValueError, match="cannot be exact"):
            call(old, new, adv, mask, "token-mean", global_batch_info={"dp_size": 2, "batch_num_tokens":
                                                                       int(mask.sum())})


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_without_a_dropped_row_any_count_is_exact_as_given(agg):
    """No row drops: the count is the step's, whatever it is (dp ranks, a larger step), as for every loss; token-sum
    divides by nothing, so a drop cannot make it inexact."""
    old, new, adv, mask = _split_case()
    keep = [0, 1, 3, 4, 5, 6, 7]  # row 2 is the dropping row
    old, new, adv, mask = old[keep], new[keep], adv[keep], mask[keep]
    own, _ = call(old, new, adv, mask, agg)
    info = {"dp_size": 2, "batch_num_tokens": 4 * int(mask.sum()), "global_batch_size": 4 * mask.shape[0]}
    loss, m = call(old, new, adv, mask, agg, global_batch_info=info)
    assert m["fipo/sequence_drop_ratio"] == 0
    # x dp_size / the count; the call's own seq count is its rows with a valid token (row 4 has none)
    factor = {"token-mean": 2 / 4, "seq-mean-token-mean": 2 * int(mask.any(-1).sum()) / (4 * mask.shape[0]),
              "token-sum": 2.0}[agg]
    torch.testing.assert_close(loss, own * factor, rtol=1e-6, atol=1e-7)
    if agg == "token-sum":  # and with a drop, token-sum (no count) stays as given
        old2, new2, adv2, mask2, _ = _one_row_drops()
        a, _ = call(old2, new2, adv2, mask2, agg)
        b, _ = call(old2, new2, adv2, mask2, agg, global_batch_info={"dp_size": 2, "batch_num_tokens": 999})
        torch.testing.assert_close(b, 2 * a)


def test_planned_row_splits_are_the_reference_objective_where_a_row_drops():
    """The step's objective: the dropped row (25 tokens) leaves the numerator and the denominator of the whole step.
    A count of every valid token is exact on the one call (the step is that call); the plan's count and
    row_keep_mask give the reference for every split."""
    from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch

    old, new, adv, mask = _split_case()
    ref_loss, _, kept, _ = fipo_loop(old, new, adv, mask)
    assert kept.count(False) == 1
    whole_lp = new.clone().requires_grad_(True)
    whole, _ = call(old, whole_lp, adv, mask)
    whole.backward()
    assert whole.item() == pytest.approx(ref_loss, rel=1e-5)
    n_valid = int(mask.sum())
    # the caller's all-valid count on the one call (the step is this call): the reference, not x kept / valid
    all_valid, _ = call(old, new, adv, mask, global_batch_info={"dp_size": 1, "batch_num_tokens": n_valid})
    assert all_valid.item() == pytest.approx(ref_loss, rel=1e-5)
    for split in ([[0, 1, 2], [3, 4], [5, 6, 7]], [[i] for i in range(8)], [[2], [0, 1, 3, 4, 5, 6, 7]]):
        widths = [max(1, int(mask[rows].sum(1).max())) for rows in split]
        lp = new.clone().requires_grad_(True)
        mbs = [MicroBatch(old[r, :w], lp[r, :w].detach(), adv[r, :w], mask[r, :w]) for r, w in zip(split, widths)]
        plan = plan_optimizer_batch("fipo", mbs, {})
        assert plan.num_tokens == n_valid - 25 and plan.row_drops.num_dropped_rows == 1
        total = 0.0
        for rows, w, extras in zip(split, widths, plan.extras):
            loss, _ = compute_policy_loss_fipo(old[rows, :w], lp[rows, :w], adv[rows, :w], mask[rows, :w],
                                               "token-mean", plan.config_for({}), **extras)
            loss.backward()
            total = total + loss.detach()
        assert total.item() == pytest.approx(ref_loss, rel=1e-5)
        torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lp.grad, whole_lp.grad, rtol=1e-6, atol=1e-8)


def test_row_selector_drops_the_rows_the_loss_drops():
    from recipe.fipo import fipo_row_selector

    g = torch.Generator().manual_seed(404)
    for _ in range(200):
        old, new, adv, mask = _case(g)
        if mask.numel() == 0:
            continue
        fw = fipo_weights(torch.where(mask, new - torch.where(mask, old, 0.0), 0.0), adv, mask,
                          fipo_params_from_config({}))
        sel = fipo_row_selector(old, new, adv, mask, config={})
        assert torch.equal(sel["row_keep_mask"], fw.loss_mask)
        assert sel["num_dropped_rows"] == int(fw.dropped_rows.sum()) and sel["num_rows"] == mask.shape[0]


def test_clip_fractions_are_the_literal_shares_of_the_loss_tokens():
    """fipo/clip_fraction: the PPO clip decided the token's loss; fipo/dual_clip_fraction: the dual clip -A w c did;
    both over the kept rows' valid tokens, checked against a per-token loop."""
    g = torch.Generator().manual_seed(77)
    checked = {"clip": 0, "dual": 0}
    for _ in range(300):
        old, new, adv, mask = _case(g)
        loss, metrics = call(old, new, adv, mask, clip_ratio_high=0.28)
        _, weights, kept, _ = fipo_loop(old, new, adv, mask, eps_high=0.28)
        n, n_clip, n_dual, ties = 0, 0, 0, 0  # ties: r within rounding of a clip bound, decided either way
        for b in range(mask.shape[0]):
            if not kept[b]:
                continue
            for t in range(mask.shape[1]):
                if not mask[b, t]:
                    continue
                d = max(-20.0, min(20.0, float(new[b, t].float() - old[b, t].float())))
                r = math.exp(d)
                ah = float(adv[b, t]) * weights[b][t]
                n += 1
                if ah == 0 or any(math.isclose(r, bound, rel_tol=1e-5) for bound in (0.8, 1.28, 10.0)):
                    ties += ah != 0
                    continue
                unclipped, clipped = -ah * r, -ah * min(max(r, 0.8), 1.28)
                n_clip += clipped > unclipped
                n_dual += ah < 0 and max(unclipped, clipped) > -ah * 10.0
        tol = (ties + 1e-6) / max(n, 1)
        assert metrics["fipo/clip_fraction"] == pytest.approx(n_clip / max(n, 1), abs=tol)
        assert metrics["fipo/dual_clip_fraction"] == pytest.approx(n_dual / max(n, 1), abs=tol)
        checked["clip"] += n_clip
        checked["dual"] += n_dual
    assert checked["clip"] > 20 and checked["dual"] > 5, checked


def test_local_token_mean_like_the_reference_is_not_split_invariant():
    """Without the global count each micro-batch divides by its own kept tokens (the reference's normalisation):
    the sum over micro-batches then depends on the split, which is why the runtimes pass global_batch_info."""
    old, new, adv, mask = _split_case()
    whole, _ = call(old, new, adv, mask)
    halves = sum(call(old[r], new[r], adv[r], mask[r])[0] * (int(mask[r].sum()) - 25 * (2 in r))
                 for r in ([0, 1, 2, 3], [4, 5, 6, 7])) / (int(mask.sum()) - 25)
    # reweighting each local mean by its kept tokens recovers the global kept-token mean (the dropped row has 25)
    assert halves.item() == pytest.approx(whole.item(), rel=1e-5)
    naive = sum(call(old[r], new[r], adv[r], mask[r])[0] for r in ([0, 1, 2, 3], [4, 5, 6, 7])) / 2
    assert abs(naive.item() - whole.item()) > 1e-3


# ------------------------------------------------------------------------------------------------- config


def test_defaults_and_config_paths():
    p = fipo_params_from_config(None)
    assert (p.decay_rate, p.clip_ratio_c, p.influence_clip_ratio, p.influence_clip_high_only, p.safety_threshold,
            p.eps_low, p.eps_high) == (32.0, 10.0, 0.2, True, 10.0, 0.2, 0.2)
    assert p.gamma == pytest.approx(0.97857, abs=1e-5)
    nested = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "policy_loss": {"fipo_decay_rate": 8,
                                                                               "fipo_influence_clip_high_only": False}}
    q = fipo_params_from_config(nested)
    assert (q.decay_rate, q.influence_clip_high_only, q.eps_low, q.eps_high) == (8.0, False, 0.1, 0.28)
    r = fipo_params_from_config({"eps_clip": 0.3, "eps_clip_higher": 0.4, "fipo_safety_threshold": 3})
    assert (r.eps_low, r.eps_high, r.safety_threshold) == (0.3, 0.4, 3.0)


@pytest.mark.parametrize("cfg, message", [
    ({"fipo_decay_rate": 0}, "fipo_decay_rate must be > 0"),
    ({"fipo_decay_rate": -1}, "fipo_decay_rate must be > 0"),
    ({"fipo_clip_ratio_c": 1.0}, "fipo_clip_ratio_c must be > 1"),
    ({"fipo_clip_ratio_c": 1.2, "clip_ratio_high": 0.28}, "fipo_clip_ratio_c must be > 1 + eps_high"),
    ({"fipo_influence_clip_ratio": -0.1}, "fipo_influence_clip_ratio must be >= 0"),
    ({"fipo_influence_clip_ratio": 1.0, "fipo_influence_clip_high_only": False}, "must be < 1 in symmetric"),
    ({"fipo_safety_threshold": 0}, "fipo_safety_threshold must be > 0"),
    ({"fipo_influence_clip_high_only": "yes"}, "fipo_influence_clip_high_only must be true or false"),
    ({"policy_loss": {"fipo_decay_rate": "x"}}, "policy_loss.fipo_decay_rate must be a number"),
])
def test_bad_config_is_rejected_naming_the_key(cfg, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        fipo_params_from_config(cfg)


def test_registered():
    assert get_policy_loss_fn("fipo") is compute_policy_loss_fipo
