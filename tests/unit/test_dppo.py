"""recipe.dppo: DPPO-Binary-TV and DPPO-Binary-KL (arXiv 2602.04879) against a literal, loop-based reading of the
paper's equations; the trust-region mask's direction, strictness and edge cases; exact under micro-batch and rank
splits; bad deltas refused in one line; padding garbage kept out; names that clash with none of verl's."""

from __future__ import annotations

import math
import re

import pytest
import torch

from recipe.common import LOSS_AGG_MODES, agg_loss
from recipe.dppo import compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv
from recipe.dppo.algorithm import binary_divergence
from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch
from recipe.registry import get_declaration, get_policy_loss_fn

FNS = {"dppo_tv": compute_policy_loss_dppo_tv, "dppo_kl": compute_policy_loss_dppo_kl}
DELTAS = {"dppo_tv": (0.15, 0.05, 0.3), "dppo_kl": (0.05, 0.01, 0.2)}


def _batch(seed=0, rows=6, cols=16, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(rows, cols, generator=g) * 0.98 + 0.01)  # probabilities across (0.01, 0.99)
    lp = torch.clamp(old + torch.randn(rows, cols, generator=g) * scale, max=-1e-4)
    adv = torch.randn(rows, 1, generator=g).expand(rows, cols).clone()
    adv[1] = 0.0
    adv[2] = -adv[2].abs()
    adv[3] = adv[3].abs()
    lengths = torch.tensor([16, 3, 9, 12, 0, 16, 7, 11])[:rows]
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return lp, old, adv, mask


def _literal_divergence(name, pi, mu):
    """Binary TV |pi - mu| / binary KL(mu || pi) of two Bernoullis, written from the definitions."""
    if name == "dppo_tv":
        return 0.5 * (abs(pi - mu) + abs((1 - pi) - (1 - mu)))
    kl = mu * math.log(mu / pi)
    if mu < 1:
        kl += (1 - mu) * (math.log(1 - mu) - math.log(1 - pi)) if pi < 1 else math.inf
    return kl


def _literal(name, lp, old, adv, mask, delta, weights=None):
    """The paper's DPPO token by token in Python floats: -(1/N) sum_t M_t r_t A_t, its gradient w.r.t. log pi, and
    the dropped tokens. M_t = 0 iff the divergence exceeds delta and pi moved the way A_t pushes."""
    n = sum(bool(m) for row in mask.tolist() for m in row)
    total, grad, dropped = 0.0, [[0.0] * len(row) for row in mask.tolist()], set()
    for i, (lp_r, old_r, a_r, m_r) in enumerate(zip(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist())):
        for j, (x, y, a, m) in enumerate(zip(lp_r, old_r, a_r, m_r)):
            if not m:
                continue
            pi, mu = math.exp(x), math.exp(y)
            outside = _literal_divergence(name, pi, mu) > delta
            if (a > 0 and pi > mu and outside) or (a < 0 and pi < mu and outside):
                dropped.add((i, j))
                continue
            r = math.exp(min(max(x - y, -20.0), 20.0))
            iw = 1.0 if weights is None else float(weights[i][j])
            total += -r * a * iw
            grad[i][j] = -r * a * iw / max(n, 1)
    return total / max(n, 1), torch.tensor(grad, dtype=torch.float64), dropped


@pytest.mark.parametrize("name", sorted(FNS))
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("which", range(3))
def test_equals_the_papers_equations_token_by_token(name, seed, which):
    delta = DELTAS[name][which]
    lp, old, adv, mask = _batch(seed)
    lp = lp.requires_grad_(True)
    loss, metrics = FNS[name](old, lp, adv, mask, config={f"{name}_delta": delta})
    loss.backward()
    ref_loss, ref_grad, dropped = _literal(name, lp.detach(), old, adv, mask, delta)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad.double(), ref_grad, rtol=1e-5, atol=1e-8)
    assert metrics[f"{name}/num_masked_tokens"] == len(dropped)
    assert metrics[f"{name}/masked_fraction"] == pytest.approx(len(dropped) / int(mask.sum()))
    pos = sum(1 for i, j in dropped if adv[i, j] > 0)
    assert (metrics[f"{name}/num_masked_pos_adv"], metrics[f"{name}/num_masked_neg_adv"]) == (pos, len(dropped) - pos)
    if which == 0 and seed == 0:  # the default delta drops tokens of both signs here: the case is a real test
        assert pos > 0 and len(dropped) - pos > 0


@pytest.mark.parametrize("name", sorted(FNS))
def test_divergence_matches_its_definition(name):
    lp, old, _, _ = _batch(2)
    got = binary_divergence(name[-2:], lp, old)
    ref = torch.tensor([[_literal_divergence(name, math.exp(x), math.exp(y)) for x, y in zip(a, b)]
                        for a, b in zip(lp.tolist(), old.tolist())])
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-7)


def _one(name, pi, mu, a, delta):
    lp = torch.log(torch.tensor([[pi]], dtype=torch.float64)).float().requires_grad_(True)
    old = torch.log(torch.tensor([[mu]], dtype=torch.float64)).float()
    loss, metrics = FNS[name](old, lp, torch.tensor([[a]]), torch.ones(1, 1, dtype=torch.bool),
                              config={f"{name}_delta": delta})
    loss.backward()
    return metrics[f"{name}/num_masked_tokens"] == 1.0, float(lp.grad)


@pytest.mark.parametrize("name", sorted(FNS))
def test_only_a_move_the_advantage_pushes_is_dropped(name):
    # pi rose from 0.2 to 0.7: far outside either radius
    assert _one(name, 0.7, 0.2, 1.0, 0.05)[0]  # A > 0 would raise it further: dropped
    dropped, grad = _one(name, 0.7, 0.2, -1.0, 0.05)  # A < 0 pulls it back: kept, with the full gradient
    assert not dropped and grad == pytest.approx(-(0.7 / 0.2) * -1.0)
    # pi fell from 0.7 to 0.2
    assert _one(name, 0.2, 0.7, -1.0, 0.05)[0]
    assert not _one(name, 0.2, 0.7, 1.0, 0.05)[0]
    # A == 0: never dropped, no gradient either way
    assert _one(name, 0.7, 0.2, 0.0, 0.05) == (False, 0.0)
    assert _one(name, 0.2, 0.7, 0.0, 0.05) == (False, 0.0)


def test_tv_radius_is_strict_and_low_probability_tokens_are_not_over_penalised():
    # divergence exactly delta (representable: 0.75 - 0.5): kept; a hair above: dropped
    assert not _one("dppo_tv", 0.75, 0.5, 1.0, 0.25)[0]
    assert _one("dppo_tv", 0.75, 0.5, 1.0, 0.2499)[0]
    # a rare token whose ratio is 5 (PPO's clip would stop it) but whose probability moved by 0.004: kept
    dropped, grad = _one("dppo_tv", 0.005, 0.001, 1.0, 0.15)
    assert not dropped and grad == pytest.approx(-5.0, rel=1e-5)


def test_kl_edge_cases_stay_finite_or_drop():
    # mu = 1 exactly (log mu = 0): the (1 - mu) term is 0 log 0 = 0, D = -log pi
    d = binary_divergence("kl", torch.log(torch.tensor([0.5])), torch.zeros(1))
    assert float(d) == pytest.approx(math.log(2.0))
    # pi = 1 exactly with mu < 1: D = inf, dropped for A > 0, and the metrics stay finite
    lp = torch.zeros(1, 1, requires_grad=True)
    loss, metrics = compute_policy_loss_dppo_kl(torch.log(torch.tensor([[0.9]])), lp, torch.ones(1, 1),
                                                torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    assert metrics["dppo_kl/num_masked_tokens"] == 1.0 and float(lp.grad) == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(FNS))
def test_a_larger_radius_never_drops_more(name):
    """TV is at most 1, so delta = 1 drops nothing; KL is unbounded."""
    lp, old, adv, mask = _batch(9)
    counts = [FNS[name](old, lp, adv, mask, config={f"{name}_delta": d})[1][f"{name}/num_masked_tokens"]
              for d in (0.001, 0.01, 0.05, 0.15, 0.5, 1.0 if name == "dppo_tv" else 1e3)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 0 and counts[-1] == 0


@pytest.mark.parametrize("name", sorted(FNS))
@pytest.mark.parametrize("value", [0, -0.1, "0.1", True, float("inf")])
def test_bad_delta_is_refused_in_one_line_naming_the_key(name, value):
    lp, old, adv, mask = _batch()
    key = f"{name}_delta"
    with pytest.raises(ValueError, match=rf"^{key} must be .*Fix: ") as err:
        FNS[name](old, lp, adv, mask, config={key: value})
    assert "\n" not in str(err.value)
    # verl's nesting (policy_loss.<key>) is read, and named, too
    with pytest.raises(ValueError, match=rf"^policy_loss\.{key} must be "):
        FNS[name](old, lp, adv, mask, config={"policy_loss": {key: value}})


@pytest.mark.parametrize("name", sorted(FNS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [1, 2, 3, 6])
def test_micro_batch_splits_sum_to_the_one_call_loss(name, mode, splits):
    lp, old, adv, mask = _batch(7)
    config = {f"{name}_delta": DELTAS[name][1]}
    whole_lp = lp.clone().requires_grad_(True)
    whole, metrics = FNS[name](old, whole_lp, adv, mask, loss_agg_mode=mode, config=config)
    whole.backward()
    assert metrics[f"{name}/num_masked_tokens"] > 0
    parts = [list(range(i, 6, splits)) for i in range(splits)]
    plan = plan_optimizer_batch(name, [MicroBatch(old[r], lp[r], adv[r], mask[r]) for r in parts], config)
    step_config = plan.config_for(config)  # the step's token count; the seq-mean modes also need its row count
    step_config["global_batch_info"]["global_batch_size"] = int(mask.any(dim=-1).sum())
    split_lp = lp.clone().requires_grad_(True)
    total = sum(FNS[name](old[r], split_lp[r], adv[r], mask[r], loss_agg_mode=mode, config=step_config,
                          **plan.extras[k])[0] for k, r in enumerate(parts))
    total.backward()
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_lp.grad, whole_lp.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", sorted(FNS))
def test_two_ranks_average_to_the_one_call_loss(name):
    lp, old, adv, mask = _batch(5)
    whole, _ = FNS[name](old, lp, adv, mask)
    info = {"global_batch_info": {"dp_size": 2, "batch_num_tokens": int(mask.sum())}}
    halves = [FNS[name](old[r], lp[r], adv[r], mask[r], config=info)[0] for r in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(sum(halves) / 2, whole, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", sorted(FNS))
def test_padding_garbage_never_reaches_the_loss_or_the_gradient(name):
    lp, old, adv, mask = _batch(3)
    clean_lp = lp.clone().requires_grad_(True)
    clean, clean_metrics = FNS[name](old, clean_lp, adv, mask)
    clean.backward()
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, float("nan"))).requires_grad_(True)
    dirty_old = torch.where(mask, old, torch.full_like(old, float("inf")))
    dirty_adv = torch.where(mask, adv, torch.full_like(adv, float("nan")))
    dirty, metrics = FNS[name](dirty_old, dirty_lp, dirty_adv, mask)
    dirty.backward()
    assert torch.equal(dirty, clean) and torch.equal(dirty_lp.grad, clean_lp.grad)
    assert metrics == clean_metrics


@pytest.mark.parametrize("name", sorted(FNS))
def test_rollout_is_weights_multiply_per_token(name):
    lp, old, adv, mask = _batch(6)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    lp = lp.requires_grad_(True)
    loss, _ = FNS[name](old, lp, adv, mask, rollout_is_weights=torch.where(mask, w, float("nan")))
    loss.backward()
    delta = get_declaration(name).defaults()[f"{name}_delta"]
    ref_loss, ref_grad, _ = _literal(name, lp.detach(), old, adv, mask, delta, weights=w.tolist())
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad.double(), ref_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", sorted(FNS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_modes_aggregate_the_per_token_loss(name, mode):
    lp, old, adv, mask = _batch(4)
    _, _, dropped = _literal(name, lp, old, adv, mask, get_declaration(name).defaults()[f"{name}_delta"])
    keep = torch.ones_like(mask)
    for i, j in dropped:
        keep[i, j] = False
    per_token = torch.where(keep, -adv * torch.exp(lp - old), 0.0)
    loss, _ = FNS[name](old, lp, adv, mask, loss_agg_mode=mode)
    torch.testing.assert_close(loss, agg_loss(per_token, mask, mode), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", sorted(FNS))
def test_empty_batch_is_zero_with_a_graph_and_same_metric_keys(name):
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = FNS[name](torch.zeros(2, 3), lp, torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert float(loss.detach()) == 0.0 and lp.grad is not None
    assert list(metrics) == list(get_declaration(name).metrics) and all(isinstance(v, float) for v in metrics.values())


def test_registered_under_their_runtime_names_and_verl_names_that_clash_with_nothing():
    for name, fn in FNS.items():
        decl = get_declaration(name)
        assert get_policy_loss_fn(name) is fn
        assert not decl.uses_ppo_clip and [p.name for p in decl.params] == [f"{name}_delta"]
        # verl 0.9.1 ships its own dppo_tv / dppo_kl; TRL 1.16 and ms-swift ship no DPPO loss_type
        assert {fw: decl.name_in(fw) for fw in ("verl", "trl", "swift")} == {
            "verl": f"stalerl_{name}", "trl": name, "swift": name}
    assert get_declaration("dppo_tv").defaults() == {"dppo_tv_delta": 0.15}
    assert get_declaration("dppo_kl").defaults() == {"dppo_kl_delta": 0.05}


@pytest.mark.parametrize("name", sorted(FNS))
def test_ms_swift_and_areal_surfaces_carry_delta(name):
    """The torch- and framework-free halves of two adapters: ms-swift's ``STALERL_<NAME>_DELTA`` (checked in one line
    naming the variable) and AReaL's ``actor.<name>_delta`` reach the loss."""
    from types import SimpleNamespace

    from recipe.areal.rules import loss_config as areal_config
    from recipe.swift.config import loss_config as swift_config

    env = f"STALERL_{name.upper()}_DELTA"
    assert swift_config(name, environ={env: "0.02"}) == {f"{name}_delta": 0.02}
    with pytest.raises(ValueError, match=rf"^{env} must be > 0"):
        swift_config(name, environ={env: "0"})
    areal = areal_config(SimpleNamespace(loss=name, eps_clip=0.2, eps_clip_higher=None, **{f"{name}_delta": 0.02}))
    assert areal[f"{name}_delta"] == 0.02
    lp, old, adv, mask = _batch(1)
    assert torch.equal(FNS[name](old, lp, adv, mask, config=areal)[0],
                       FNS[name](old, lp, adv, mask, config={f"{name}_delta": 0.02})[0])
