"""recipe.m2po.algorithm: Algorithm 1 selection, the M2PO loss, config, metrics, edge cases, split invariance.

Deterministic CPU tests. The randomised comparison against a literal loop lives in test_m2po_reference.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import m2po_dist_worker  # noqa: E402
from m2po_reference import reference_m2po  # noqa: E402

from recipe.common import LOSS_AGG_MODES, agg_loss  # noqa: E402
from recipe.m2po import (  # noqa: E402
    DEFAULT_M2_THRESHOLD,
    METRIC_KEYS,
    M2POSelection,
    compute_policy_loss_m2po,
    m2_threshold_from_config,
    m2po_batch_selector,
    select_m2po,
    selection_from_mask,
    trust_region_mask,
)

F32 = torch.float32


def t2(rows, dtype=F32):
    return torch.tensor(rows, dtype=dtype)


def row(values, dtype=F32):
    return torch.tensor([values], dtype=dtype)


def ones_mask(like):
    return torch.ones(like.shape, dtype=torch.bool)


def select(d, a, tau, mask=None):
    d = d if isinstance(d, torch.Tensor) else row(d)
    a = a if isinstance(a, torch.Tensor) else row(a)
    if a.shape != d.shape:
        a = a.expand(d.shape).clone()
    mask = ones_mask(d) if mask is None else mask
    return select_m2po(d, a, mask, tau)


def keep_list(sel: M2POSelection):
    return [int(x) for x in sel.keep_mask.flatten().tolist()]


def m2po_loss(lp, old, adv, mask, keep=None, **config):
    return compute_policy_loss_m2po(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                                    loss_agg_mode=config.pop("loss_agg_mode", "token-mean"),
                                    config=config or None, keep_mask=keep)


# ----------------------------------------------------------------------------------------------------------------
# The reference document's test vectors
# ----------------------------------------------------------------------------------------------------------------


def test_vector_trinity_three_tokens():
    sel = select([0.1, 0.2, 0.3], [1.0, 1.0, 1.0], 0.04)
    assert keep_list(sel) == [1, 1, 0]
    assert sel.m2_after == pytest.approx(0.025, abs=1e-7)
    assert sel.m2_before == pytest.approx((0.01 + 0.04 + 0.09) / 3, abs=1e-7)
    assert (sel.num_valid, sel.num_trust_region, sel.num_masked) == (3, 3, 1)


def test_vector_trinity_mixed_quadrants():
    sel = select([1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, 1.0, -1.0], 0.1)
    assert keep_list(sel) == [1, 1, 0, 0]
    # only tokens 2 (A>0, r>1) and 3 (A<0, r<1) are in T
    assert sel.trust_region.flatten().tolist() == [False, False, True, True]
    assert sel.m2_before == 1.0 and sel.m2_after == 0.0


def test_vector_two_small_two_large_masks_exactly_one():
    small, large = math.sqrt(0.001), math.sqrt(0.1)
    # all four in T (two through each quadrant), large values not adjacent
    sel = select([large, small, -large, -small], [1.0, 1.0, -1.0, -1.0], 0.04)
    assert sel.num_trust_region == 4
    assert sel.num_masked == 1
    # the later of the two equal-ish large values goes first; both have d^2 == f32(0.1)
    assert keep_list(sel) == [1, 1, 0, 1]
    assert sel.m2_after == pytest.approx((0.001 + 0.001 + 0.1) / 3, rel=1e-6)


def test_vector_trinity_split_example():
    d = [0.1, 0.3, math.sqrt(0.05)]  # d^2 = 0.01, 0.09, 0.05
    full = select(d, [1.0] * 3, 0.04)
    assert keep_list(full) == [1, 0, 1]
    # per-part selection (what a per-micro-batch implementation does) gives a different answer
    part1 = select(d[:2], [1.0, 1.0], 0.04)
    part2 = select(d[2:], [1.0], 0.04)
    assert keep_list(part1) + keep_list(part2) == [1, 0, 0]


def test_vector_loss_minus_half():
    lp = row([0.0, 1.0]).requires_grad_()
    old = row([0.0, 0.0])
    adv = row([1.0, 1.0])
    mask = ones_mask(lp)
    keep = torch.tensor([[True, False]])
    loss, _ = m2po_loss(lp, old, adv, mask, keep=keep)
    assert loss.item() == pytest.approx(-0.5, abs=1e-7)
    loss.backward()
    assert lp.grad.tolist() == [[pytest.approx(-0.5, abs=1e-7), 0.0]]


# ----------------------------------------------------------------------------------------------------------------
# Trust region: quadrants and strictness
# ----------------------------------------------------------------------------------------------------------------


def test_quadrants():
    d = row([0.5, 0.5, -0.5, -0.5, 0.5, -0.5])
    a = row([1.0, -1.0, 1.0, -1.0, 0.0, 0.0])
    assert trust_region_mask(d, a, ones_mask(d)).flatten().tolist() == [True, False, False, True, False, False]
    sel = select(d, a, 0.0)  # tau = 0: everything in T goes
    assert keep_list(sel) == [0, 1, 1, 0, 1, 1]
    assert sel.trust_region.flatten().tolist() == [True, False, False, True, False, False]


def test_strictness_zero_advantage_and_zero_log_ratio_never_in_t():
    # huge d with A = 0, and d == 0 (r == 1) with A != 0: never in T, never masked, even at tau = 0
    d = row([5.0, -5.0, 0.0, 0.0, -0.0, 3.0])
    a = row([0.0, 0.0, 1.0, -1.0, -2.0, -0.0])
    sel = select(d, a, 0.0)
    assert sel.num_trust_region == 0
    assert keep_list(sel) == [1] * 6
    assert sel.m2_before == 0.0 and sel.m2_after == 0.0


def test_advantage_sign_taken_per_token_not_from_position_zero():
    d = row([0.5, 0.5])
    a = row([-1.0, 1.0])  # position 0 negative, position 1 positive
    sel = select(d, a, 0.0)
    assert keep_list(sel) == [1, 0]


def test_tokens_outside_t_are_kept_whatever_their_m2():
    # a token with enormous d^2 outside T stays; the small T token is judged alone
    sel = select([10.0, 0.1], [-1.0, 1.0], 0.04)
    assert keep_list(sel) == [1, 1]
    assert sel.num_trust_region == 1 and sel.m2_before == pytest.approx(0.01, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Threshold and stopping rule
# ----------------------------------------------------------------------------------------------------------------


def test_remaining_mean_exactly_tau_stops():
    # d^2 = 0.25, 0.0625, 1.0 (all exact); after dropping 1.0 the mean is (0.25 + 0.0625)/2 = 0.15625 == tau
    sel = select([0.5, 0.25, 1.0], [1.0, 1.0, 1.0], 0.15625)
    assert keep_list(sel) == [1, 1, 0]
    assert sel.m2_after == 0.15625
    # a strict "< tau" rule (AReaL) would also drop 0.25; one ulp below tau it must
    below = select([0.5, 0.25, 1.0], [1.0, 1.0, 1.0], math.nextafter(0.15625, 0.0))
    assert keep_list(below) == [0, 1, 0]


def test_single_token_exactly_tau_is_kept():
    sel = select([0.5], [1.0], 0.25)
    assert keep_list(sel) == [1]
    assert keep_list(select([0.5], [1.0], math.nextafter(0.25, 0.0))) == [0]


def test_float32_square_just_above_tau_is_masked():
    # f32(0.1) > 0.1: a token whose f32 d^2 equals f32(0.1) has mean > tau = 0.1 and must go. Comparing the f32
    # tensor with tau rounds tau to f32 and would call it "<= tau" (regression test).
    d = torch.tensor([[0.1]], dtype=torch.float32).sqrt()
    sq = float((d * d).item())
    assert sq > 0.1
    sel = select(d, row([1.0]), 0.1)
    assert keep_list(sel) == [0]
    assert sel.m2_before == sq
    # two such tokens: the mean is still above tau, both go; with a small companion both stay
    assert keep_list(select(torch.cat([d, d], 1), row([1.0, 1.0]), 0.1)) == [0, 0]
    assert keep_list(select(torch.cat([d, torch.tensor([[0.25]])], 1), row([1.0, 1.0]), 0.1)) == [1, 1]


def test_tau_zero_masks_all_of_t():
    d = row([0.01, -0.02, 0.3, -0.4, 0.5])
    a = row([1.0, -1.0, 1.0, 1.0, -1.0])  # T = {0, 1, 2}
    sel = select(d, a, 0.0)
    assert keep_list(sel) == [0, 0, 0, 1, 1]
    assert sel.num_masked == 3 and sel.m2_after == 0.0


def test_everything_above_tau_masks_all_of_t_and_loss_stays_finite():
    lp = row([1.0, 2.0, -1.0]).requires_grad_()
    old = torch.zeros_like(lp)
    adv = row([1.0, 1.0, 1.0])  # tokens 0, 1 in T (both > tau), token 2 not
    loss, m = m2po_loss(lp, old, adv, ones_mask(lp), m2_threshold=0.04)
    assert m["m2po/num_masked_tokens"] == 2.0
    expected = -math.exp(-1.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert lp.grad.tolist() == [[0.0, 0.0, pytest.approx(expected, rel=1e-6)]]


def test_empty_trust_region():
    sel = select([0.5, -0.5, 0.0], [-1.0, 1.0, 1.0], 0.04)
    assert sel.num_trust_region == 0 and sel.num_masked == 0
    assert keep_list(sel) == [1, 1, 1]
    assert sel.metrics()["m2po/trust_region_fraction"] == 0.0
    assert sel.m2_before == 0.0


def test_larger_tau_never_masks_more():
    g = torch.Generator().manual_seed(3)
    d = torch.randn(8, 32, generator=g) * 0.3
    a = torch.randn(8, 1, generator=g).expand(8, 32).clone()
    counts = [select(d, a, tau).num_masked for tau in (0.0, 0.01, 0.04, 0.1, 0.5, 10.0)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] == select(d, a, 0.0).num_trust_region and counts[-1] == 0


# ----------------------------------------------------------------------------------------------------------------
# Ties
# ----------------------------------------------------------------------------------------------------------------


def test_ties_later_token_masked_first():
    # d^2: 0.25, 0.015625, 0.25, 0.25; tau = (0.015625 + 0.25)/2 exactly -> keep the small one and the FIRST 0.25
    d = row([0.5, 0.125, -0.5, 0.5])
    a = row([1.0, 1.0, -1.0, 1.0])
    sel = select(d, a, 0.1328125)
    assert keep_list(sel) == [1, 1, 0, 0]


def test_ties_across_rows_row_major_order():
    d = t2([[0.5, 0.125], [0.5, 0.5]])
    a = torch.ones_like(d)
    sel = select(d, a, 0.1328125)
    assert sel.keep_mask.tolist() == [[True, True], [False, False]]


def test_ties_deterministic_across_calls():
    g = torch.Generator().manual_seed(11)
    d = torch.randint(-4, 5, (16, 64), generator=g).float() / 8
    a = torch.randint(-1, 2, (16, 64), generator=g).float()
    first = select(d, a, 0.05)
    for _ in range(3):
        again = select(d.clone(), a.clone(), 0.05)
        assert torch.equal(again.keep_mask, first.keep_mask)
    # the number masked depends only on the multiset of values: reversing the order keeps the count
    rev = select(d.flip(1), a.flip(1), 0.05)
    assert rev.num_masked == first.num_masked


# ----------------------------------------------------------------------------------------------------------------
# Empty batches and padding
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_batch_loss_zero_connected_to_graph(shape, mode):
    lp = torch.zeros(shape, requires_grad=True)
    old = torch.zeros(shape)
    adv = torch.zeros(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    loss, metrics = m2po_loss(lp, old, adv, mask, loss_agg_mode=mode)
    assert loss.shape == () and loss.item() == 0.0
    assert loss.requires_grad and loss.grad_fn is not None
    loss.backward()
    assert lp.grad is not None and lp.grad.shape == shape
    assert list(metrics) == list(METRIC_KEYS)
    assert all(v == 0.0 for k, v in metrics.items() if k != "m2po/threshold")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_padding_batch_with_garbage(mode):
    lp = torch.full((2, 4), float("nan")).requires_grad_()
    old = torch.full((2, 4), float("inf"))
    adv = torch.full((2, 4), float("nan"))
    mask = torch.zeros(2, 4, dtype=torch.bool)
    loss, metrics = m2po_loss(lp, old, adv, mask, loss_agg_mode=mode)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 4))
    assert metrics["m2po/num_valid_tokens"] == 0.0
    sel = m2po_batch_selector(old, lp.detach(), adv, mask)["selection"]
    assert sel.num_valid == 0 and not sel.keep_mask.any()


def test_padding_garbage_is_ignored_and_gradients_stay_finite():
    nan, inf = float("nan"), float("inf")
    lp = t2([[0.1, 0.2, nan, inf], [0.3, -inf, nan, 1e30]]).requires_grad_()
    old = t2([[0.0, 0.0, inf, nan], [0.0, nan, -inf, 0.0]])
    adv = t2([[1.0, 1.0, nan, inf], [1.0, nan, 1.0, 1.0]])
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    loss, metrics = m2po_loss(lp, old, adv, mask, m2_threshold=0.04)
    # same as the clean batch: T = {0.1, 0.2, 0.3}, mean 0.0467 > 0.04 -> drop 0.3; kept 0.1, 0.2
    assert metrics["m2po/num_valid_tokens"] == 3.0 and metrics["m2po/num_masked_tokens"] == 1.0
    expected = -(math.exp(0.1) + math.exp(0.2)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[~mask].eq(0).all()
    assert lp.grad[0, 0].item() == pytest.approx(-math.exp(0.1) / 3, rel=1e-6)
    assert lp.grad[1, 0].item() == 0.0  # masked


def test_padding_never_masked_never_counted():
    d = t2([[0.3, 0.3, 0.3], [0.3, 0.0, 0.0]])
    a = torch.ones_like(d)
    mask = torch.tensor([[True, False, False], [True, False, False]])
    sel = select(d, a, 0.0, mask=mask)
    assert sel.num_valid == 2 and sel.num_trust_region == 2 and sel.num_masked == 2
    assert not sel.keep_mask[~mask].any()  # padding is not "kept" either
    assert not sel.trust_region[~mask].any()


def test_float_response_mask_accepted():
    d = row([0.1, 0.2, 0.3, 5.0])
    a = row([1.0, 1.0, 1.0, 1.0])
    maskf = row([1.0, 1.0, 1.0, 0.0])
    sel = select_m2po(d, a, maskf, 0.04)
    assert keep_list(sel) == [1, 1, 0, 0]


# ----------------------------------------------------------------------------------------------------------------
# Non-finite values on valid tokens
# ----------------------------------------------------------------------------------------------------------------


def test_non_finite_on_valid_tokens_raises_with_counts():
    nan, inf = float("nan"), float("inf")
    lp = t2([[0.1, nan, 0.2], [inf, 0.0, 0.0]])
    old = t2([[0.0, 0.0, -inf], [0.0, 0.0, 0.0]])
    adv = t2([[1.0, 1.0, 1.0], [1.0, nan, 1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError) as exc:
        m2po_loss(lp, old, adv, mask)
    msg = str(exc.value)
    assert re.search(r"(?<!old_)log_prob: 2 \(first at row 0, token 1\)", msg), msg
    assert "old_log_prob: 1 (first at row 0, token 2)" in msg
    assert "advantages: 1 (first at row 1, token 1)" in msg
    with pytest.raises(ValueError, match=r"non-finite values on valid tokens"):
        m2po_batch_selector(old, lp, adv, mask)


def test_nan_only_on_padding_does_not_raise():
    lp = t2([[0.1, float("nan")]])
    mask = torch.tensor([[True, False]])
    loss, _ = m2po_loss(lp, torch.zeros_like(lp), torch.ones_like(lp), mask)
    assert math.isfinite(loss.item())


# ----------------------------------------------------------------------------------------------------------------
# Huge log-ratios: d clamped to +-20 before exp (zero gradient beyond, as verl); selection uses the unclamped d
# ----------------------------------------------------------------------------------------------------------------


def test_huge_log_ratio_forward_clamped_gradient_zero():
    # both tokens outside T, so neither is masked: A < 0 with d = +30, A > 0 with d = -30; a third, in-range token
    lp = row([30.0, -30.0, 0.5]).requires_grad_()
    old = torch.zeros_like(lp)
    adv = row([-1.0, 2.0, 1.0])
    loss, m = m2po_loss(lp, old, adv, ones_mask(lp), m2_threshold=1e9)
    assert m["m2po/num_masked_tokens"] == 0.0
    expected = (1.0 * math.exp(20.0) - 2.0 * math.exp(-20.0) - math.exp(0.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    # a kept token with |d| > 20 gets exactly zero gradient (not |A| e^20 / N), and nothing is non-finite
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == 0.0
    assert lp.grad[0, 2].item() == pytest.approx(-math.exp(0.5) / 3, rel=1e-6)


def test_log_ratio_at_the_bound_keeps_its_gradient():
    lp = row([20.0, -20.0]).requires_grad_()
    loss, _ = m2po_loss(lp, torch.zeros_like(lp), row([-1.0, 1.0]), ones_mask(lp), m2_threshold=1e9)
    loss.backward()
    assert lp.grad[0, 0].item() == pytest.approx(math.exp(20.0) / 2, rel=1e-5)
    assert lp.grad[0, 1].item() == pytest.approx(-math.exp(-20.0) / 2, rel=1e-5)


def test_selection_uses_unclamped_log_ratio():
    # T = one token with d = 25 (d^2 = 625) plus 600 tokens with d = 0.5 (d^2 = 0.25); tau = 1.
    # unclamped: (625 + 150)/601 = 1.29 > 1 -> the big token is masked.
    # clamped at 20: (400 + 150)/601 = 0.92 <= 1 -> it would be kept.
    d = torch.full((1, 601), 0.5)
    d[0, 0] = 25.0
    for sign in (1.0, -1.0):
        sel = select(d * sign, torch.full_like(d, sign), 1.0)
        assert sel.num_masked == 1 and not sel.keep_mask[0, 0]
        assert sel.m2_before == pytest.approx((625 + 150) / 601, rel=1e-6)
    lp = (d.clone()).requires_grad_()
    loss, m = m2po_loss(lp, torch.zeros_like(lp), torch.ones_like(lp), ones_mask(lp), m2_threshold=1.0)
    assert m["m2po/num_masked_tokens"] == 1.0
    assert loss.item() == pytest.approx(-600 * math.exp(0.5) / 601, rel=1e-5)


def test_overflowing_square_is_masked_not_nan():
    # finite float32 d whose square overflows to inf: masked, the loss and gradients stay finite
    lp = row([1e30, 0.1, 0.1]).requires_grad_()
    old = torch.zeros_like(lp)
    loss, m = m2po_loss(lp, old, torch.ones_like(lp), ones_mask(lp), m2_threshold=0.04)
    assert m["m2po/num_masked_tokens"] == 1.0
    assert loss.item() == pytest.approx(-2 * math.exp(0.1) / 3, rel=1e-6)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 0].item() == 0.0


# ----------------------------------------------------------------------------------------------------------------
# Dtypes
# ----------------------------------------------------------------------------------------------------------------


def test_bf16_inputs_square_in_fp32():
    # lp = bf16(0.2) = 0.2001953125; d^2 in fp32 = 0.04007816..., in bf16 it would round to 0.0400390625 == tau
    tau = 0.0400390625
    lp = torch.tensor([[0.2]], dtype=torch.bfloat16)
    old = torch.zeros_like(lp)
    adv = torch.ones_like(lp)
    assert float((lp * lp).item()) == tau  # the bf16 square is not above tau...
    sel = select_m2po(lp - old, adv, ones_mask(lp), tau)
    assert keep_list(sel) == [0]  # ...the fp32 one is
    assert sel.m2_before == pytest.approx(0.2001953125 ** 2, rel=1e-7)
    lp_g = lp.clone().requires_grad_()
    loss, m = m2po_loss(lp_g, old, adv, ones_mask(lp), m2_threshold=tau)
    assert m["m2po/num_masked_tokens"] == 1.0
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp_g.grad.dtype == torch.bfloat16


def test_bf16_matches_fp32_of_the_same_values():
    g = torch.Generator().manual_seed(5)
    lp = (torch.randn(6, 40, generator=g) * 0.3).bfloat16()
    old = (torch.randn(6, 40, generator=g) * 0.1).bfloat16()
    adv = torch.randn(6, 1, generator=g).expand(6, 40).bfloat16()
    mask = torch.rand(6, 40, generator=g) < 0.8
    lp16 = lp.clone().requires_grad_()
    lp32 = lp.float().requires_grad_()
    loss16, m16 = m2po_loss(lp16, old, adv, mask)
    loss32, m32 = m2po_loss(lp32, old.float(), adv.float(), mask)
    assert m16 == m32
    assert loss16.item() == pytest.approx(loss32.item(), rel=1e-6)
    loss16.backward()
    loss32.backward()
    torch.testing.assert_close(lp16.grad.float(), lp32.grad.bfloat16().float())


def test_fp64_inputs_work():
    lp = t2([[0.1, 0.2, 0.3]], dtype=torch.float64).requires_grad_()
    old = torch.zeros_like(lp)
    loss, m = m2po_loss(lp, old, torch.ones_like(lp), ones_mask(lp))
    assert m["m2po/num_masked_tokens"] == 1.0
    loss.backward()
    assert lp.grad.dtype == torch.float64
    assert lp.grad[0, 2].item() == 0.0


# ----------------------------------------------------------------------------------------------------------------
# Gradients against the literal formula loss = -sum(keep * A * exp(d)) / N_valid
# ----------------------------------------------------------------------------------------------------------------


def _random_batch(seed, rows=8, cols=48, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 2
    d = torch.randn(rows, cols, generator=g) * scale
    tail = torch.rand(rows, cols, generator=g) < 0.05
    d = torch.where(tail, d * 6, d)
    lp = old + d
    adv_row = torch.randn(rows, 1, generator=g)
    adv_row[torch.rand(rows, 1, generator=g) < 0.2] = 0.0
    adv = adv_row.expand(rows, cols).clone()
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return lp, old, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gradient_matches_literal_formula(seed):
    lp, old, adv, mask = _random_batch(seed)
    lp_ours = lp.clone().requires_grad_()
    loss, metrics = m2po_loss(lp_ours, old, adv, mask)
    loss.backward()

    keep = select_m2po(lp - old, adv, mask, DEFAULT_M2_THRESHOLD).keep_mask
    assert metrics["m2po/num_masked_tokens"] > 0  # the case exercises the mask
    lp64 = lp.double().requires_grad_()
    n_valid = mask.sum()
    literal = -(keep.double() * adv.double() * torch.exp(lp64 - old.double())).sum() / n_valid
    literal.backward()
    assert loss.item() == pytest.approx(literal.item(), rel=1e-5)
    torch.testing.assert_close(lp_ours.grad.double(), lp64.grad, rtol=1e-5, atol=1e-8)
    assert lp_ours.grad[~keep].eq(0).all()


def test_no_gradient_flows_through_the_selection():
    lp, old, adv, mask = _random_batch(7)
    lp_req = lp.clone().requires_grad_()
    sel = select_m2po(lp_req - old, adv, mask, 0.04)
    assert not sel.keep_mask.requires_grad
    out = m2po_batch_selector(old, lp_req, adv, mask)
    assert not out["keep_mask"].requires_grad


def test_old_log_prob_gets_no_gradient():
    lp, old, adv, mask = _random_batch(8)
    lp = lp.requires_grad_()
    old = old.requires_grad_()
    loss, _ = m2po_loss(lp, old, adv, mask)
    loss.backward()
    assert old.grad is None or old.grad.eq(0).all()


def test_rollout_is_weights_multiply_per_token():
    lp, old, adv, mask = _random_batch(9)
    g = torch.Generator().manual_seed(99)
    w = torch.rand(lp.shape, generator=g) + 0.5
    w[~mask] = float("nan")  # garbage on padding is ignored
    keep = select_m2po(lp - old, adv, mask, 0.04).keep_mask
    lp_req = lp.clone().requires_grad_()
    loss, _ = compute_policy_loss_m2po(old, lp_req, adv, mask, config=None, rollout_is_weights=w)
    wz = torch.where(mask, w, torch.zeros_like(w))
    literal = -(keep * adv * torch.exp(lp - old) * wz).sum() / mask.sum()
    assert loss.item() == pytest.approx(literal.item(), rel=1e-5)
    loss.backward()
    assert torch.isfinite(lp_req.grad).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_agg_modes_apply_to_masked_per_token_loss(mode):
    lp, old, adv, mask = _random_batch(12)
    keep = select_m2po(lp - old, adv, mask, 0.04).keep_mask
    loss, _ = compute_policy_loss_m2po(old, lp, adv, mask, loss_agg_mode=mode)
    per_token = torch.where(keep, -adv * torch.exp(lp - old), torch.zeros_like(lp))
    assert loss.item() == pytest.approx(agg_loss(per_token, mask, mode).item(), rel=1e-5, abs=1e-7)


def test_unknown_agg_mode_raises():
    lp, old, adv, mask = _random_batch(12)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss_m2po(old, lp, adv, mask, loss_agg_mode="seq-mean")


# ----------------------------------------------------------------------------------------------------------------
# keep_mask path
# ----------------------------------------------------------------------------------------------------------------


def test_keep_mask_from_selector_gives_same_loss_as_self_selection():
    lp, old, adv, mask = _random_batch(13)
    out = m2po_batch_selector(old, lp, adv, mask, config={"m2_threshold": 0.04})
    assert set(out) == {"keep_mask", "selection"}
    a, ma = compute_policy_loss_m2po(old, lp, adv, mask, keep_mask=out["keep_mask"])
    b, mb = compute_policy_loss_m2po(old, lp, adv, mask)
    assert a.item() == b.item()
    assert ma == pytest.approx(mb)
    assert torch.equal(out["keep_mask"], out["selection"].keep_mask)


def test_keep_mask_is_applied_as_given():
    lp = row([0.1, 0.2, 0.3])
    old = torch.zeros_like(lp)
    adv = row([1.0, -1.0, 0.0])
    keep = torch.tensor([[False, True, True]])
    loss, m = m2po_loss(lp, old, adv, ones_mask(lp), keep=keep)
    assert loss.item() == pytest.approx(math.exp(0.2) / 3, rel=1e-6)
    assert m["m2po/num_masked_tokens"] == 1.0
    assert m["m2po/masked_fraction"] == pytest.approx(1 / 3)


def test_keep_mask_wrong_shape_raises():
    lp = row([0.1, 0.2])
    with pytest.raises(ValueError, match="keep_mask has shape"):
        m2po_loss(lp, torch.zeros_like(lp), torch.ones_like(lp), ones_mask(lp), keep=torch.ones(2, 2, dtype=torch.bool))


def test_selection_from_mask_diagnostics():
    d = row([0.1, 0.2, 0.3, -0.5])
    a = row([1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([[True, True, True, True]])
    keep = torch.tensor([[True, True, False, True]])
    sel = selection_from_mask(d, a, mask, keep, 0.04)
    assert (sel.num_valid, sel.num_trust_region, sel.num_masked) == (4, 3, 1)
    assert sel.m2_before == pytest.approx((0.01 + 0.04 + 0.09) / 3, rel=1e-6)
    assert sel.m2_after == pytest.approx(0.025, rel=1e-6)
    assert sel.threshold == 0.04


# ----------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------


def test_metrics_same_keys_python_floats_every_call():
    calls = []
    lp, old, adv, mask = _random_batch(21)
    calls.append(compute_policy_loss_m2po(old, lp, adv, mask)[1])
    calls.append(compute_policy_loss_m2po(old, lp, adv, mask, keep_mask=torch.ones_like(mask))[1])
    calls.append(compute_policy_loss_m2po(old, lp, adv, torch.zeros_like(mask))[1])
    calls.append(compute_policy_loss_m2po(old[:0], lp[:0], adv[:0], mask[:0])[1])
    calls.append(compute_policy_loss_m2po(old, old, adv, mask)[1])  # r == 1: empty T
    for metrics in calls:
        assert list(metrics) == list(METRIC_KEYS)
        assert all(type(v) is float for v in metrics.values()), metrics
        assert all(math.isfinite(v) for v in metrics.values())


def test_metric_fractions():
    # valid: 5 tokens (one padding); T = {0, 1, 2}; masked = {2}
    d = row([0.1, 0.2, 0.3, -0.3, 0.0, 9.0])
    a = row([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([[True, True, True, True, True, False]])
    m = compute_policy_loss_m2po(torch.zeros_like(d), d, a, mask, config={"m2_threshold": 0.04})[1]
    assert m["m2po/num_valid_tokens"] == 5.0
    assert m["m2po/num_trust_region_tokens"] == 3.0
    assert m["m2po/num_masked_tokens"] == 1.0
    assert m["m2po/masked_fraction"] == pytest.approx(1 / 5)
    assert m["m2po/trust_region_fraction"] == pytest.approx(3 / 5)
    assert m["m2po/m2_before"] == pytest.approx((0.01 + 0.04 + 0.09) / 3, rel=1e-6)
    assert m["m2po/m2_after"] == pytest.approx(0.025, rel=1e-6)
    assert m["m2po/threshold"] == 0.04


def test_m2_after_never_exceeds_tau():
    for seed in range(10):
        lp, old, adv, mask = _random_batch(seed, scale=0.5)
        for tau in (0.0, 0.01, 0.04, 0.2):
            sel = select_m2po(lp - old, adv, mask, tau)
            assert sel.m2_after <= tau
            # maximality: putting back the smallest masked token would break the threshold
            masked = mask & ~sel.keep_mask
            if masked.any():
                sq = (lp - old).float() ** 2
                kept_t = sel.trust_region & sel.keep_mask
                back = sq[masked].min()
                total = sq[kept_t].double().sum() + back.double()
                assert (total / (kept_t.sum() + 1)).item() > tau


# ----------------------------------------------------------------------------------------------------------------
# Threshold from config
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _PolicyLoss:
    loss_mode: str = "m2po"
    m2_threshold: float = 0.3


@dataclasses.dataclass
class _ActorConfig:
    policy_loss: _PolicyLoss = dataclasses.field(default_factory=_PolicyLoss)
    clip_ratio: float = 0.2


@pytest.mark.parametrize("config, expected", [
    (None, DEFAULT_M2_THRESHOLD),
    ({}, DEFAULT_M2_THRESHOLD),
    ({"m2_threshold": 0.1}, 0.1),
    ({"m2_threshold": 1}, 1.0),
    ({"policy_loss": {"m2_threshold": 0.5}, "m2_threshold": 0.1}, 0.5),
    ({"policy_loss": {"loss_mode": "m2po"}, "m2_threshold": 0.1}, 0.1),
    ({"policy_loss": None, "m2_threshold": 0.2}, 0.2),
    ({"policy_loss": {"m2_threshold": None}}, DEFAULT_M2_THRESHOLD),
    (SimpleNamespace(policy_loss=SimpleNamespace(m2_threshold=0.5), m2_threshold=0.1), 0.5),
    (SimpleNamespace(m2_threshold=0.2), 0.2),
    (SimpleNamespace(policy_loss=SimpleNamespace(loss_mode="m2po")), DEFAULT_M2_THRESHOLD),
    (OmegaConf.create({"policy_loss": {"m2_threshold": 0.5}, "m2_threshold": 0.1}), 0.5),
    (OmegaConf.create({"m2_threshold": 0.07}), 0.07),
    (_ActorConfig(), 0.3),
    (0.0, DEFAULT_M2_THRESHOLD),  # an object with neither key: the default
])
def test_threshold_from_config(config, expected):
    assert m2_threshold_from_config(config) == expected


def test_threshold_from_struct_dictconfig():
    cfg = OmegaConf.create({"policy_loss": {"loss_mode": "m2po"}, "clip_ratio": 0.2})
    OmegaConf.set_struct(cfg, True)
    assert m2_threshold_from_config(cfg) == DEFAULT_M2_THRESHOLD
    cfg2 = OmegaConf.create({"policy_loss": {"m2_threshold": 0.25}})
    OmegaConf.set_struct(cfg2, True)
    assert m2_threshold_from_config(cfg2) == 0.25


def test_threshold_from_config_drives_the_selection():
    d = row([0.1, 0.2, 0.3])
    a = torch.ones_like(d)
    mask = ones_mask(d)
    for config, masked in (({"m2_threshold": 0.04}, 1), ({"policy_loss": {"m2_threshold": 0.0}}, 3),
                           (SimpleNamespace(m2_threshold=0.05), 0)):
        _, m = compute_policy_loss_m2po(torch.zeros_like(d), d, a, mask, config=config)
        assert m["m2po/num_masked_tokens"] == masked
        sel = m2po_batch_selector(torch.zeros_like(d), d, a, mask, config=config)["selection"]
        assert sel.num_masked == masked


@pytest.mark.parametrize("bad", [-0.01, float("nan"), float("inf"), "abc", True, False, [0.1]])
@pytest.mark.parametrize("where", ["policy_loss.m2_threshold", "m2_threshold"])
def test_bad_threshold_raises_naming_the_key(bad, where):
    config = {"policy_loss": {"m2_threshold": bad}} if where.startswith("policy_loss") else {"m2_threshold": bad}
    pattern = re.escape(where)
    with pytest.raises(ValueError, match=pattern):
        m2_threshold_from_config(config)
    d = row([0.1])
    with pytest.raises(ValueError, match=pattern):
        compute_policy_loss_m2po(torch.zeros_like(d), d, torch.ones_like(d), ones_mask(d), config=config)
    with pytest.raises(ValueError, match=pattern):
        m2po_batch_selector(torch.zeros_like(d), d, torch.ones_like(d), ones_mask(d), config=config)


def test_bad_threshold_attribute_config_names_the_key():
    with pytest.raises(ValueError, match=r"policy_loss\.m2_threshold"):
        m2_threshold_from_config(SimpleNamespace(policy_loss=SimpleNamespace(m2_threshold=-1.0)))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "0.04", None])
def test_select_m2po_rejects_bad_tau(bad):
    d = row([0.1])
    with pytest.raises(ValueError, match="m2_threshold"):
        select_m2po(d, torch.ones_like(d), ones_mask(d), bad)


def test_select_m2po_accepts_int_tau_and_huge_tau():
    d = row([0.1, 3.0])
    assert keep_list(select_m2po(d, torch.ones_like(d), ones_mask(d), 0)) == [0, 0]
    assert keep_list(select_m2po(d, torch.ones_like(d), ones_mask(d), 1e300)) == [1, 1]


def test_bad_scope_raises_and_dp_group_needs_distributed():
    d = row([0.1])
    args = (torch.zeros_like(d), d, torch.ones_like(d), ones_mask(d))
    with pytest.raises(ValueError, match="m2_scope"):
        compute_policy_loss_m2po(*args, config={"m2_scope": "global"})
    with pytest.raises(ValueError, match=r"policy_loss\.m2_scope"):
        compute_policy_loss_m2po(*args, config={"policy_loss": {"m2_scope": "world"}})
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        with pytest.raises(ValueError, match="dp_group"):
            compute_policy_loss_m2po(*args, config={"m2_scope": "dp_group"})
    # 'local' is the default and explicit 'local' is accepted
    compute_policy_loss_m2po(*args, config={"m2_scope": "local"})


def test_shape_mismatch_raises():
    d = row([0.1, 0.2])
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_policy_loss_m2po(torch.zeros_like(d), d, torch.ones(1, 3), ones_mask(d))


# ----------------------------------------------------------------------------------------------------------------
# Split invariance (a): one selection over the mini-batch, then the loss per micro-batch
# ----------------------------------------------------------------------------------------------------------------


def _split_batch(seed=0, rows=7, cols=12):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g)
    d = torch.randint(-6, 7, (rows, cols), generator=g).float() / 16  # ties
    tail = torch.rand(rows, cols, generator=g) < 0.1
    d = torch.where(tail, d * 8, d)
    lp = old + d
    adv = (torch.randint(-1, 2, (rows, 1), generator=g).float()
           * (torch.rand(rows, 1, generator=g) + 0.5)).expand(rows, cols).clone()
    lengths = torch.tensor([12, 3, 7, 0, 12, 5, 9])[:rows]
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    # engines leave garbage on padding
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    old = torch.where(mask, old, torch.full_like(old, float("inf")))
    adv = torch.where(mask, adv, torch.full_like(adv, float("nan")))
    return lp, old, adv, mask, lengths


def _repad(t, width, fill):
    """Trim to ``width`` columns (dropping only padding) or pad with ``fill`` up to it."""
    if width <= t.shape[1]:
        return t[:, :width]
    extra = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype)
    return torch.cat([t, extra], dim=1)


@pytest.mark.parametrize("splits, extra_pad", [
    ([7], 0),
    ([1] * 7, 0),
    ([2, 3, 2], 0),
    ([3, 4], 0),
    ([4, 1, 2], 3),
    ([1, 2, 1, 3], 5),
])
@pytest.mark.parametrize("tau", [0.04, 0.0, 0.3])
def test_split_invariance_with_batch_selector(splits, extra_pad, tau):
    lp, old, adv, mask, lengths = _split_batch()
    config = {"m2_threshold": tau}
    n_total = int(mask.sum())

    lp_full = lp.clone().requires_grad_()
    sel = m2po_batch_selector(old, lp_full.detach(), adv, mask, config=config)
    keep = sel["keep_mask"]
    full_loss, full_metrics = compute_policy_loss_m2po(old, lp_full, adv, mask, config=config, keep_mask=keep)
    full_loss.backward()
    # same as the loss selecting by itself over the whole batch
    self_loss, _ = compute_policy_loss_m2po(old, lp.clone(), adv, mask, config=config)
    assert self_loss.item() == full_loss.item()

    lp_split = lp.clone().requires_grad_()
    micro_config = {"m2_threshold": tau, "global_batch_info": {"dp_size": 1, "batch_num_tokens": n_total}}
    total = 0.0
    keeps = []
    start = 0
    for size in splits:
        rows = slice(start, start + size)
        start += size
        width = int(lengths[rows].max()) + extra_pad  # verl pads each micro-batch to its own longest response
        mb = dict(old_log_prob=_repad(old[rows], width, float("inf")),
                  log_prob=_repad(lp_split[rows], width, float("nan")),
                  advantages=_repad(adv[rows], width, float("nan")),
                  response_mask=_repad(mask[rows], width, False))
        mb_keep = _repad(keep[rows], width, False)
        loss, metrics = compute_policy_loss_m2po(**mb, config=micro_config, keep_mask=mb_keep)
        assert list(metrics) == list(METRIC_KEYS)
        keeps.append(_repad(mb_keep, lp.shape[1], False))
        loss.backward()
        total += loss.item()
    assert torch.equal(torch.cat(keeps), keep)
    assert total == pytest.approx(full_loss.item(), rel=1e-5, abs=1e-7)
    assert torch.isfinite(lp_split.grad).all()
    torch.testing.assert_close(lp_split.grad, lp_full.grad, rtol=1e-6, atol=1e-8)
    assert full_metrics["m2po/num_valid_tokens"] == n_total


def test_per_micro_batch_selection_is_not_split_invariant():
    # the reason for the selector: selecting per micro-batch changes the mask (Trinity's split example)
    d = row([0.1, 0.3, math.sqrt(0.05)])
    lp = d.clone()
    old = torch.zeros_like(d)
    adv = torch.ones_like(d)
    mask = ones_mask(d)
    keep = m2po_batch_selector(old, lp, adv, mask)["keep_mask"]
    assert keep.flatten().tolist() == [True, False, True]
    cfg = {"global_batch_info": {"dp_size": 1, "batch_num_tokens": 3}}
    with_sel = sum(compute_policy_loss_m2po(old[:, s], lp[:, s], adv[:, s], mask[:, s], config=cfg,
                                            keep_mask=keep[:, s])[0].item() for s in (slice(0, 2), slice(2, 3)))
    without = sum(compute_policy_loss_m2po(old[:, s], lp[:, s], adv[:, s], mask[:, s], config=cfg)[0].item()
                  for s in (slice(0, 2), slice(2, 3)))
    full = compute_policy_loss_m2po(old, lp, adv, mask)[0].item()
    assert with_sel == pytest.approx(full, rel=1e-6)
    assert without == pytest.approx(-math.exp(0.1) / 3, rel=1e-6)
    assert without != pytest.approx(full, rel=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# Split invariance (b): two gloo processes
# ----------------------------------------------------------------------------------------------------------------


def _unsplit_reference(case, tau):
    """The whole batch in one process: rows of rank 0, then rank 1, padded to a common width."""
    parts = case["ranks"]
    width = max(p["lp_base"].shape[1] for p in parts)

    def cat(key, fill):
        return torch.cat([_repad(p[key], width, fill) for p in parts])

    base, old, adv = cat("lp_base", float("nan")), cat("old", float("inf")), cat("adv", float("nan"))
    mask = cat("mask", False)
    feats = torch.cat([torch.cat([p["feats"], torch.zeros(p["feats"].shape[0], width - p["feats"].shape[1],
                                                          p["feats"].shape[2])], dim=1) for p in parts])
    theta = torch.zeros(feats.shape[-1], requires_grad=True)
    lp = base + feats @ theta
    lp.retain_grad()
    sel = select_m2po(lp.detach() - old, adv, mask, tau)
    loss, metrics = compute_policy_loss_m2po(old, lp, adv, mask, config={"m2_threshold": tau},
                                             keep_mask=sel.keep_mask)
    loss.backward()
    return {"sel": sel, "loss": loss.item(), "theta_grad": theta.grad.clone(), "lp_grad": lp.grad.clone(),
            "width": width}


DIST_CASES = ("uneven", "rank1_empty", "ties_across_ranks")


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    """Spawn two gloo ranks once for all cases; returns {case name: [rank 0 result, rank 1 result]}."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("m2po_gloo")
    cases = [m2po_dist_worker.make_case(name) for name in DIST_CASES]
    mp.spawn(m2po_dist_worker.run_rank, args=(2, str(out), cases, 0.04), nprocs=2, join=True)
    return {name: [torch.load(out / f"{name}_rank{r}.pt") for r in range(2)] for name in DIST_CASES}


@pytest.mark.dist
@pytest.mark.parametrize("case_name", DIST_CASES)
def test_two_process_gloo_matches_unsplit(dist_results, case_name):
    tau = 0.04
    case = m2po_dist_worker.make_case(case_name)
    ref = _unsplit_reference(case, tau)
    assert ref["sel"].num_masked > 0  # the case exercises the cross-rank decision
    results = dist_results[case_name]

    n_global = int(sum(int(p["mask"].sum()) for p in case["ranks"]))
    row0 = 0
    for rank, (res, part) in enumerate(zip(results, case["ranks"])):
        rows = slice(row0, row0 + part["mask"].shape[0])
        row0 += part["mask"].shape[0]
        w = part["mask"].shape[1]
        ref_keep = ref["sel"].keep_mask[rows, :w]
        assert torch.equal(res["selector"]["keep"], ref_keep), rank
        # dp_group scope does not return its mask; it shows where A != 0: a kept token has a non-zero gradient
        observable = part["mask"] & (torch.nan_to_num(part["adv"]) != 0)
        assert torch.equal((res["dp_group"]["lp_grad"] != 0)[observable], ref_keep[observable]), rank
        for method in ("selector", "dp_group"):
            out = res[method]
            # per-token gradient of the rank's loss, averaged over dp_size ranks, is the unsplit gradient
            torch.testing.assert_close(out["lp_grad"] / 2, ref["lp_grad"][rows, :w], rtol=1e-6, atol=1e-9)
            # the shared parameter's gradient, all-reduced and averaged as DDP/FSDP do
            torch.testing.assert_close(out["theta_grad_avg"], ref["theta_grad"], rtol=1e-5, atol=1e-8)
        sel = res["selection"]
        assert torch.equal(sel["keep"], ref["sel"].keep_mask[rows, :w])
        # the same mask from the full-size pass (no compaction) and from the sort the radix select replaces
        assert torch.equal(res["selection_full_size"], sel["keep"])
        assert torch.equal(res["selection_sort"], sel["keep"])
        for key in ("num_valid", "num_trust_region", "num_masked"):
            assert sel[key] == getattr(ref["sel"], key), key
        assert sel["m2_before"] == pytest.approx(ref["sel"].m2_before, rel=1e-12)
        assert sel["m2_after"] == pytest.approx(ref["sel"].m2_after, rel=1e-12)
        # m2_scope=dp_group reports the global selection
        assert res["dp_group"]["metrics"]["m2po/num_valid_tokens"] == n_global
        assert res["dp_group"]["metrics"]["m2po/num_masked_tokens"] == ref["sel"].num_masked
        assert list(res["dp_group"]["metrics"]) == list(METRIC_KEYS)
    for method in ("selector", "dp_group"):
        mean_loss = sum(r[method]["loss"] for r in results) / 2
        assert mean_loss == pytest.approx(ref["loss"], rel=1e-5, abs=1e-8)


def test_reference_agrees_on_the_dist_cases():
    # the unsplit answers used above agree with the literal loop
    for name in ("uneven", "rank1_empty"):
        case = m2po_dist_worker.make_case(name)
        parts = case["ranks"]
        width = max(p["lp_base"].shape[1] for p in parts)
        d = torch.cat([_repad(p["lp_base"] - p["old"], width, 0.0) for p in parts])
        adv = torch.cat([_repad(p["adv"], width, 0.0) for p in parts])
        mask = torch.cat([_repad(p["mask"], width, False) for p in parts])
        d = torch.where(mask, d, torch.zeros_like(d))
        sel = select_m2po(d, adv, mask, 0.04)
        expected = reference_m2po(d.tolist(), torch.where(mask, adv, torch.zeros_like(adv)).tolist(),
                                  mask.tolist(), 0.04)
        assert sel.keep_mask.tolist() == expected["keep"]


def test_key_sort_equals_stable_sort():
    from recipe.m2po.algorithm import _sort_by_value_then_position

    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 1000, 70000):
        values = (torch.randint(0, 40, (n,), generator=g).float() / 7) ** 2  # many ties, exact zeros
        values[: n // 10] = float("inf")
        values = values[torch.randperm(n, generator=g)]
        got_vals, got_order = _sort_by_value_then_position(values)
        want_vals, want_order = torch.sort(values, stable=True)
        assert torch.equal(got_vals, want_vals) and torch.equal(got_order, want_order), n
