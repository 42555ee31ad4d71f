"""recipe.cispo: CISPO (MiniMax-M1) against a literal, loop-based reference; exact under micro-batch and rank splits;
bad clip values refused in one line; padding garbage kept out; names that clash with no framework's own loss."""

from __future__ import annotations

import math
import re

import pytest
import torch

from recipe.cispo import compute_policy_loss_cispo
from recipe.cispo.algorithm import METRIC_KEYS
from recipe.common import LOSS_AGG_MODES, agg_loss
from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch
from recipe.registry import get_declaration, get_policy_loss_fn


def _batch(seed=0, rows=6, cols=16, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 2 - 0.05
    lp = old + torch.randn(rows, cols, generator=g) * scale
    adv = torch.randn(rows, 1, generator=g).expand(rows, cols).clone()
    adv[1] = 0.0
    adv[2] = -adv[2].abs()
    adv[3] = adv[3].abs()
    lengths = torch.tensor([16, 3, 9, 12, 0, 16, 7, 11])[:rows]
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return lp, old, adv, mask


def _literal(lp, old, adv, mask, low, high, weights=None):
    """CISPO token by token in Python floats: the token-mean loss and d loss / d log_prob per token."""
    n = sum(bool(m) for row in mask.tolist() for m in row)
    total, grad = 0.0, [[0.0] * len(row) for row in mask.tolist()]
    for i, (lp_r, old_r, a_r, m_r) in enumerate(zip(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist())):
        for j, (x, y, a, m) in enumerate(zip(lp_r, old_r, a_r, m_r)):
            if not m:
                continue
            r = math.exp(min(max(x - y, -20.0), 20.0))
            w = min(max(r, 1.0 - low), 1.0 + high)  # a constant: the gradient flows only through log pi
            iw = 1.0 if weights is None else float(weights[i][j])
            total += -w * a * x * iw
            grad[i][j] = -w * a * iw / max(n, 1)
    return total / max(n, 1), torch.tensor(grad, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28), (1.0, 4.0), (0.05, 0.5)])
def test_equals_the_literal_reference(seed, low, high):
    lp, old, adv, mask = _batch(seed)
    lp = lp.requires_grad_(True)
    loss, metrics = compute_policy_loss_cispo(old, lp, adv, mask,
                                              config={"clip_ratio_low": low, "clip_ratio_high": high})
    loss.backward()
    ref_loss, ref_grad = _literal(lp.detach(), old, adv, mask, low, high)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad.double(), ref_grad, rtol=1e-5, atol=1e-8)
    r = torch.exp(lp.detach() - old)[mask]
    assert metrics["cispo/clip_fraction_low"] == pytest.approx(float((r < 1 - low).float().mean()))
    assert metrics["cispo/clip_fraction_high"] == pytest.approx(float((r > 1 + high).float().mean()))
    if (low, high) == (0.2, 0.2) and seed == 0:  # the case exercises both clips
        assert metrics["cispo/clip_fraction_low"] > 0 and metrics["cispo/clip_fraction_high"] > 0


def test_every_token_keeps_a_gradient_unlike_ppo_clip():
    """The clipped ratio is a weight, not a gate: a token far outside the clip still gets -w A / N."""
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    lp = torch.log(torch.tensor([[0.9, 0.1]])).requires_grad_(True)  # r = 1.8 and 0.2
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = compute_policy_loss_cispo(old, lp, adv, torch.ones(1, 2, dtype=torch.bool),
                                        config={"eps_clip": 0.2, "eps_clip_higher": 0.28})
    loss.backward()
    # weights 1.28 (capped) and 0.8 (raised): gradient -w A / 2
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28 / 2, 0.8 / 2]]))


@pytest.mark.parametrize("config,expected", [
    ({}, (0.2, 0.2)),
    ({"eps_clip": 0.3}, (0.3, 0.3)),
    ({"eps_clip": 0.3, "eps_clip_higher": 0.5}, (0.3, 0.5)),
    ({"clip_ratio": 0.1}, (0.1, 0.1)),
    ({"clip_ratio": 0.1, "clip_ratio_low": None, "clip_ratio_high": 0.4}, (0.1, 0.4)),  # verl: None -> clip_ratio
])
def test_reads_the_frameworks_ppo_clip(config, expected):
    from recipe.cispo.algorithm import clip_range

    assert clip_range(config) == pytest.approx(expected)


@pytest.mark.parametrize("config,key", [
    ({"eps_clip": -0.1}, "eps_clip"),
    ({"clip_ratio_high": "0.3"}, "clip_ratio_high"),
    ({"eps_clip_higher": float("nan")}, "eps_clip_higher"),
    ({"clip_ratio_low": True}, "clip_ratio_low"),
])
def test_bad_clip_values_are_refused_in_one_line_naming_the_key(config, key):
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=rf"^{re.escape(key)} must be .*Fix: ") as err:
        compute_policy_loss_cispo(old, lp, adv, mask, config=config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("splits", [1, 2, 3, 6])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_splits_sum_to_the_one_call_loss(splits, mode):
    lp, old, adv, mask = _batch(7)
    config = {"eps_clip": 0.2, "eps_clip_higher": 0.28}
    whole_lp = lp.clone().requires_grad_(True)
    whole, _ = compute_policy_loss_cispo(old, whole_lp, adv, mask, loss_agg_mode=mode, config=config)
    whole.backward()
    parts = [list(range(i, 6, splits)) for i in range(splits)]  # interleaved rows: order must not matter
    mbs = [MicroBatch(old[r], lp[r], adv[r], mask[r]) for r in parts]
    plan = plan_optimizer_batch("cispo", mbs, config)
    step_config = plan.config_for(config)  # the step's token count; the seq-mean modes also need its row count
    step_config["global_batch_info"]["global_batch_size"] = int(mask.any(dim=-1).sum())
    split_lp = lp.clone().requires_grad_(True)
    total = sum(compute_policy_loss_cispo(old[r], split_lp[r], adv[r], mask[r], loss_agg_mode=mode,
                                          config=step_config, **plan.extras[k])[0]
                for k, r in enumerate(parts))
    total.backward()
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_lp.grad, whole_lp.grad, rtol=1e-6, atol=1e-9)


def test_two_ranks_average_to_the_one_call_loss():
    lp, old, adv, mask = _batch(5)
    whole, _ = compute_policy_loss_cispo(old, lp, adv, mask)
    info = {"global_batch_info": {"dp_size": 2, "batch_num_tokens": int(mask.sum())}}
    halves = [compute_policy_loss_cispo(old[r], lp[r], adv[r], mask[r], config=info)[0]
              for r in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(sum(halves) / 2, whole, rtol=1e-6, atol=1e-8)


def test_a_per_micro_batch_token_mean_would_not_be_exact():
    """The test above is not vacuous: normalising each micro-batch by its own tokens gives another loss."""
    lp, old, adv, mask = _batch(7)
    whole, _ = compute_policy_loss_cispo(old, lp, adv, mask)
    local = sum(compute_policy_loss_cispo(old[r], lp[r], adv[r], mask[r])[0] * int(mask[r].sum()) / int(mask.sum())
                for r in (slice(0, 3), slice(3, 6)))
    naive = sum(compute_policy_loss_cispo(old[r], lp[r], adv[r], mask[r])[0] for r in (slice(0, 3), slice(3, 6)))
    torch.testing.assert_close(local, whole, rtol=1e-6, atol=1e-8)
    assert abs(float(naive - whole)) > 1e-3


def test_padding_garbage_never_reaches_the_loss_or_the_gradient():
    lp, old, adv, mask = _batch(3)
    clean_lp = lp.clone().requires_grad_(True)
    clean, _ = compute_policy_loss_cispo(old, clean_lp, adv, mask)
    clean.backward()
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, float("nan"))).requires_grad_(True)
    dirty_old = torch.where(mask, old, torch.full_like(old, float("inf")))
    dirty_adv = torch.where(mask, adv, torch.full_like(adv, float("nan")))
    dirty, metrics = compute_policy_loss_cispo(dirty_old, dirty_lp, dirty_adv, mask)
    dirty.backward()
    assert torch.equal(dirty, clean)
    assert torch.equal(dirty_lp.grad, clean_lp.grad)
    assert all(math.isfinite(v) for v in metrics.values())


def test_rollout_is_weights_multiply_per_token():
    lp, old, adv, mask = _batch(6)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    lp = lp.requires_grad_(True)
    loss, _ = compute_policy_loss_cispo(old, lp, adv, mask, rollout_is_weights=torch.where(mask, w, float("nan")))
    loss.backward()
    ref_loss, ref_grad = _literal(lp.detach(), old, adv, mask, 0.2, 0.2, weights=w.tolist())
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad.double(), ref_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_modes_aggregate_the_per_token_loss(mode):
    lp, old, adv, mask = _batch(4)
    loss, _ = compute_policy_loss_cispo(old, lp, adv, mask, loss_agg_mode=mode)
    per_token = -torch.clamp(torch.exp(lp - old), 0.8, 1.2) * adv * lp
    torch.testing.assert_close(loss, agg_loss(per_token, mask, mode), rtol=1e-6, atol=1e-8)


def test_empty_batch_is_zero_with_a_graph_and_same_metric_keys():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = compute_policy_loss_cispo(torch.zeros(2, 3), lp, torch.ones(2, 3), torch.zeros(2, 3, dtype=bool))
    loss.backward()
    assert float(loss.detach()) == 0.0 and lp.grad is not None
    assert tuple(metrics) == METRIC_KEYS and all(isinstance(v, float) for v in metrics.values())


def test_registered_under_its_runtime_name_and_framework_names_that_clash_with_nothing():
    decl = get_declaration("cispo")
    assert get_policy_loss_fn("cispo") is compute_policy_loss_cispo
    assert decl.uses_ppo_clip and decl.params == ()
    # verl 0.9.1, TRL 1.16 and ms-swift ship a "cispo" of their own
    assert {fw: decl.name_in(fw) for fw in ("verl", "trl", "swift", "areal", "trinity")} == {
        "verl": "stalerl_cispo", "trl": "stalerl_cispo", "swift": "stalerl_cispo", "areal": "cispo",
        "trinity": "cispo"}
    assert set(decl.metrics) == set(METRIC_KEYS)


def test_ms_swift_and_areal_surfaces_hand_the_loss_their_ppo_clip():
    """The torch- and framework-free halves of two adapters: ms-swift's ``--loss_type stalerl_cispo`` with
    ``--epsilon`` / ``--epsilon_high``, AReaL's ``actor.eps_clip`` / ``eps_clip_higher``, give the loss that clip."""
    from types import SimpleNamespace

    from recipe.areal.rules import loss_config as areal_config
    from recipe.swift.config import loss_config as swift_config, swift_loss_types

    assert swift_loss_types()["stalerl_cispo"] == "cispo" and "cispo" not in swift_loss_types()
    lp, old, adv, mask = _batch(2)
    expected, _ = compute_policy_loss_cispo(old, lp, adv, mask, config={"eps_clip": 1.0, "eps_clip_higher": 4.0})
    swift = swift_config("stalerl_cispo", epsilon_low=1.0, epsilon_high=4.0, environ={})
    areal = areal_config(SimpleNamespace(loss="cispo", eps_clip=1.0, eps_clip_higher=4.0))
    for config in (swift, areal):
        assert torch.equal(compute_policy_loss_cispo(old, lp, adv, mask, config=config)[0], expected)
