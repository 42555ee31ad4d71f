"""recipe.baselines: ``vanilla`` is PPO's clipped surrogate (verl's formula, dual clip, asymmetric eps);
``no_trust_region`` is M2PO with an infinite threshold."""

from __future__ import annotations

import math
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from recipe.baselines import compute_policy_loss_no_trust_region, compute_policy_loss_vanilla
from recipe.baselines.algorithm import NO_TR_METRIC_KEYS, VANILLA_METRIC_KEYS
from recipe.common import LOSS_AGG_MODES, agg_loss
from recipe.m2po import compute_policy_loss_m2po

HUGE_TAU = sys.float_info.max  # tau = infinity for every finite d^2 (the config reader wants a finite number)


def _batch(seed=0, rows=6, cols=16, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 2
    lp = old + torch.randn(rows, cols, generator=g) * scale
    adv = torch.randn(rows, 1, generator=g).expand(rows, cols).clone()
    adv[1] = 0.0
    adv[2] = -adv[2].abs()  # make sure both signs are present
    adv[3] = adv[3].abs()
    lengths = torch.tensor([16, 3, 9, 12, 0, 16])[:rows]
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return lp, old, adv, mask


def _literal_ppo_token(lp, old, a, low, high, c=None):
    """One token of verl's compute_policy_loss_vanilla, in plain Python."""
    ratio = math.exp(lp - old)
    l1 = -a * ratio
    l2 = -a * min(max(ratio, 1 - low), 1 + high)
    clip1 = max(l1, l2)
    if c is not None and a < 0:
        return min(-a * c, clip1)
    return clip1


def _literal_vanilla(lp, old, adv, mask, low, high, c=None):
    total, n = 0.0, 0
    for lp_r, old_r, a_r, m_r in zip(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()):
        for x, y, a, m in zip(lp_r, old_r, a_r, m_r):
            if m:
                total += _literal_ppo_token(x, y, a, low, high, c)
                n += 1
    return total / max(n, 1)


def _torch_literal_vanilla(lp, old, adv, mask, low, high, c=None):
    """The same formula in torch (float64), for gradients."""
    ratio = torch.exp(lp - old)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    per_token = clip1 if c is None else torch.where(adv < 0, torch.minimum(-adv * c, clip1), clip1)
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("config, low, high, c", [
    (None, 0.2, 0.2, None),
    ({"clip_ratio": 0.1}, 0.1, 0.1, None),
    ({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, 0.2, 0.28, None),
    ({"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 3.0}, 0.1, 0.3, 3.0),
    ({"clip_ratio_c": 1.5}, 0.2, 0.2, 1.5),
    ({"eps_clip": 0.15, "eps_clip_higher": 0.25, "c_clip": 2.0}, 0.15, 0.25, 2.0),  # AReaL-style names
    ({"eps_clip": 0.3}, 0.3, 0.3, None),
    (SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.05, clip_ratio_high=0.4, clip_ratio_c=None), 0.05, 0.4, None),
    (OmegaConf.create({"clip_ratio_low": 0.1, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}), 0.1, 0.2, 3.0),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_vanilla_equals_literal_ppo(config, low, high, c, seed):
    lp, old, adv, mask = _batch(seed, scale=0.6)
    lp_ours = lp.clone().requires_grad_()
    loss, metrics = compute_policy_loss_vanilla(old, lp_ours, adv, mask, config=config)
    assert loss.item() == pytest.approx(_literal_vanilla(lp, old, adv, mask, low, high, c), rel=1e-5, abs=1e-7)
    loss.backward()
    lp64 = lp.double().requires_grad_()
    _torch_literal_vanilla(lp64, old.double(), adv.double(), mask, low, high, c).backward()
    torch.testing.assert_close(lp_ours.grad.double(), lp64.grad, rtol=1e-5, atol=1e-8)
    # clip metrics as verl computes them
    ratio = torch.exp(lp - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    n = mask.sum()
    assert metrics["vanilla/clip_fraction"] == pytest.approx(((l2 > l1) & mask).sum().item() / n.item(), abs=1e-7)
    if c is not None:
        lower = (torch.maximum(l1, l2) > -adv * c) & (adv < 0) & mask
        assert metrics["vanilla/dual_clip_fraction"] == pytest.approx(lower.sum().item() / n.item(), abs=1e-7)
    else:
        assert metrics["vanilla/dual_clip_fraction"] == 0.0
    assert metrics["vanilla/ppo_kl"] == pytest.approx(((old - lp) * mask).sum().item() / n.item(), rel=1e-5)


def test_vanilla_clip_fraction_nonzero_and_dual_clip_active():
    # large ratios so that both clips bite
    lp, old, adv, mask = _batch(3, scale=1.5)
    _, m = compute_policy_loss_vanilla(old, lp, adv, mask, config={"clip_ratio_c": 3.0})
    assert m["vanilla/clip_fraction"] > 0.1
    assert m["vanilla/dual_clip_fraction"] > 0.0


def test_vanilla_known_values():
    # A > 0, r = e^0.5 = 1.65 -> clipped at 1.2; A < 0, r = e^2 = 7.39 -> dual clip caps -A*r at -A*3
    lp = torch.tensor([[0.5, 2.0, 0.0]])
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = compute_policy_loss_vanilla(old, lp.requires_grad_(), adv, mask, config={"clip_ratio_c": 3.0})
    assert loss.item() == pytest.approx((-1.2 + 3.0 - 2.0) / 3, rel=1e-6)
    loss.backward()
    # clipped tokens have no gradient; the unclipped one has -A*r/N
    assert lp.grad.tolist() == [[0.0, 0.0, pytest.approx(-2.0 / 3, rel=1e-6)]]
    assert m["vanilla/clip_fraction"] == pytest.approx(1 / 3)
    assert m["vanilla/dual_clip_fraction"] == pytest.approx(1 / 3)


def test_vanilla_asymmetric_clip_directions():
    # A > 0 is clipped above at 1 + high, A < 0 below at 1 - low
    lp = torch.tensor([[math.log(2.0), math.log(0.5)]])
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = compute_policy_loss_vanilla(old, lp, adv, torch.ones(1, 2, dtype=torch.bool),
                                          config={"clip_ratio_low": 0.1, "clip_ratio_high": 0.3})
    assert loss.item() == pytest.approx((-1.3 + 0.9) / 2, rel=1e-6)


@pytest.mark.parametrize("config, key", [
    ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
    ({"clip_ratio_c": 0.5}, "clip_ratio_c"),
    ({"c_clip": float("nan")}, "c_clip"),
    ({"clip_ratio_low": -0.1}, "clip_ratio_low"),
    ({"clip_ratio_high": "wide"}, "clip_ratio_high"),
    ({"eps_clip": True}, "eps_clip"),
])
def test_vanilla_bad_config_raises_naming_key(config, key):
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=rf"^{re.escape(key)} "):
        compute_policy_loss_vanilla(old, lp, adv, mask, config=config)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_agg_modes(mode):
    lp, old, adv, mask = _batch(4)
    loss, _ = compute_policy_loss_vanilla(old, lp, adv, mask, loss_agg_mode=mode)
    ratio = torch.exp(lp - old)
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    assert loss.item() == pytest.approx(agg_loss(per_token, mask, mode).item(), rel=1e-5, abs=1e-7)


def test_vanilla_global_batch_info_dp_split():
    lp, old, adv, mask = _batch(5)
    full, _ = compute_policy_loss_vanilla(old, lp, adv, mask)
    info = {"global_batch_info": {"dp_size": 2, "batch_num_tokens": int(mask.sum())}}
    halves = [compute_policy_loss_vanilla(old[r], lp[r], adv[r], mask[r], config=info)[0].item()
              for r in (slice(0, 2), slice(2, 6))]
    assert sum(halves) / 2 == pytest.approx(full.item(), rel=1e-6)


def test_vanilla_rollout_is_weights():
    lp, old, adv, mask = _batch(6)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    w[~mask] = float("nan")
    loss, _ = compute_policy_loss_vanilla(old, lp, adv, mask, rollout_is_weights=w)
    ratio = torch.exp(lp - old)
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)) * torch.nan_to_num(w)
    assert loss.item() == pytest.approx(((per_token * mask).sum() / mask.sum()).item(), rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# no_trust_region
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_no_trust_region_equals_m2po_with_infinite_tau(seed, mode):
    lp, old, adv, mask = _batch(seed, scale=1.0)
    a = lp.clone().requires_grad_()
    b = lp.clone().requires_grad_()
    loss_ntr, _ = compute_policy_loss_no_trust_region(old, a, adv, mask, loss_agg_mode=mode)
    loss_m2, m = compute_policy_loss_m2po(old, b, adv, mask, loss_agg_mode=mode, config={"m2_threshold": HUGE_TAU})
    assert m["m2po/num_masked_tokens"] == 0.0
    assert loss_ntr.item() == pytest.approx(loss_m2.item(), rel=1e-6, abs=1e-8)
    loss_ntr.backward()
    loss_m2.backward()
    torch.testing.assert_close(a.grad, b.grad)
    # and not equal to M2PO at the default threshold on this stale batch
    loss_default, m_default = compute_policy_loss_m2po(old, lp, adv, mask, loss_agg_mode=mode)
    assert m_default["m2po/num_masked_tokens"] > 0
    assert loss_default.item() != pytest.approx(loss_ntr.item(), rel=1e-4)


def test_no_trust_region_equals_literal_formula():
    lp, old, adv, mask = _batch(7, scale=0.8)
    a = lp.clone().requires_grad_()
    loss, metrics = compute_policy_loss_no_trust_region(old, a, adv, mask)
    lp64 = lp.double().requires_grad_()
    literal = -(adv.double() * torch.exp(lp64 - old.double()) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(literal.item(), rel=1e-6)
    loss.backward()
    literal.backward()
    torch.testing.assert_close(a.grad.double(), lp64.grad, rtol=1e-5, atol=1e-9)
    r = torch.exp(lp - old)[mask]
    assert metrics["no_trust_region/ratio_mean"] == pytest.approx(r.mean().item(), rel=1e-5)
    assert metrics["no_trust_region/ratio_max"] == pytest.approx(r.max().item(), rel=1e-6)
    assert metrics["no_trust_region/ppo_kl"] == pytest.approx((old - lp)[mask].mean().item(), rel=1e-5)


def test_no_trust_region_huge_log_ratio_zero_gradient():
    lp = torch.tensor([[30.0, -30.0, 0.5]], requires_grad=True)
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    loss, _ = compute_policy_loss_no_trust_region(old, lp, adv, torch.ones(1, 3, dtype=torch.bool))
    assert loss.item() == pytest.approx(-(math.exp(20) + math.exp(-20) + math.exp(0.5)) / 3, rel=1e-5)
    loss.backward()
    assert lp.grad[0, :2].tolist() == [0.0, 0.0]
    assert lp.grad[0, 2].item() == pytest.approx(-math.exp(0.5) / 3, rel=1e-6)


def test_vanilla_huge_log_ratio_zero_gradient():
    # A < 0 with d = 30: the unclipped branch (-A r, r clamped at e^20) wins the max; its gradient is 0, not e^20
    lp = torch.tensor([[30.0, 0.05]], requires_grad=True)
    loss, _ = compute_policy_loss_vanilla(torch.zeros_like(lp), lp, torch.tensor([[-1.0, 1.0]]),
                                          torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-math.exp(0.05) / 2, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Shared behaviour
# ----------------------------------------------------------------------------------------------------------------

LOSSES = [(compute_policy_loss_vanilla, VANILLA_METRIC_KEYS), (compute_policy_loss_no_trust_region, NO_TR_METRIC_KEYS)]


@pytest.mark.parametrize("fn, keys", LOSSES)
def test_metrics_stable_python_floats(fn, keys):
    lp, old, adv, mask = _batch(8)
    for args in ((old, lp, adv, mask), (old, lp, adv, torch.zeros_like(mask)),
                 (old[:0], lp[:0], adv[:0], mask[:0]), (old[:, :0], lp[:, :0], adv[:, :0], mask[:, :0])):
        loss, metrics = fn(*args)
        assert list(metrics) == list(keys)
        assert all(type(v) is float and math.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("fn, keys", LOSSES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_batch_zero_with_graph(fn, keys, mode):
    for shape in ((0, 4), (2, 0), (2, 4)):
        lp = torch.zeros(shape, requires_grad=True)
        loss, _ = fn(torch.zeros(shape), lp, torch.zeros(shape), torch.zeros(shape, dtype=torch.bool),
                     loss_agg_mode=mode)
        assert loss.item() == 0.0 and loss.requires_grad
        loss.backward()


@pytest.mark.parametrize("fn, keys", LOSSES)
def test_non_finite_valid_raises_padding_ok(fn, keys):
    lp, old, adv, mask = _batch(9)
    bad = lp.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"log_prob: 1 \(first at row 0, token 0\)"):
        fn(old, bad, adv, mask)
    dirty = lp.clone()
    dirty[~mask] = float("nan")
    old_dirty = old.clone()
    old_dirty[~mask] = float("inf")
    adv_dirty = adv.clone()
    adv_dirty[~mask] = float("nan")
    leaf = dirty.requires_grad_()
    loss, _ = fn(old_dirty, leaf, adv_dirty, mask)
    assert loss.item() == pytest.approx(fn(old, lp, adv, mask)[0].item(), rel=1e-6)
    loss.backward()
    assert torch.isfinite(leaf.grad).all() and leaf.grad[~mask].eq(0).all()
