"""Per-quadrant diagnostics of M2PO's masked and clip's clipped tokens (issue 30, item 1).

Each loss reports, for the trust-region quadrants pos_r_gt_1 (A > 0, r > 1) and neg_r_lt_1 (A < 0, r < 1), how many
tokens it removed and their share of the trust region's gradient weight |A r|. Checked against a literal per-token
loop, for split invariance (optimizer-batch plan, the runtime's micro-batches), and for leaving the loss and its
gradient bit for bit as they were.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from recipe.baselines.algorithm import VANILLA_METRIC_KEYS, compute_policy_loss_vanilla
from recipe.common import agg_loss, check_inputs, clamp_log_ratio, masked_log_ratio, ppo_clip_surrogate
from recipe.m2po import METRIC_KEYS, QUADRANT_METRIC_KEYS, compute_policy_loss_m2po, select_m2po
from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch


def _batch(seed: int, rows: int = 8, cols: int = 40, scale: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 2
    d = torch.randn(rows, cols, generator=g) * scale
    tail = torch.rand(rows, cols, generator=g) < 0.08
    d = torch.where(tail, d * 8, d)  # some |d| beyond the +-20 clamp too
    lp = old + d
    adv = torch.randn(rows, 1, generator=g)
    adv[torch.rand(rows, 1, generator=g) < 0.2] = 0.0
    adv = adv.expand(rows, cols).clone()
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))  # garbage on padding, as engines leave it
    return lp, old, adv, mask


def literal_quadrants(lp, old, adv, mask, removed) -> dict[str, float]:
    """Token by token: T, |A r| with the loss's clamped ratio, removed tokens per quadrant and their weight."""
    total, w = 0.0, {"pos_r_gt_1": 0.0, "neg_r_lt_1": 0.0}
    n = {"pos_r_gt_1": 0, "neg_r_lt_1": 0}
    would_clip = 0  # tokens of T that PPO's clip at eps 0.2 would zero: A > 0, r > 1.2 or A < 0, r < 0.8
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if not mask[i, j]:
                continue
            d = float(lp[i, j]) - float(old[i, j])
            a = float(adv[i, j])
            quadrant = "pos_r_gt_1" if (a > 0 and d > 0) else "neg_r_lt_1" if (a < 0 and d < 0) else None
            if quadrant is None:
                continue
            r = math.exp(max(-20.0, min(20.0, d)))
            weight = abs(a) * r
            total += weight
            would_clip += (a > 0 and r > 1.2) or (a < 0 and r < 0.8)
            if removed[i][j]:
                n[quadrant] += 1
                w[quadrant] += weight
    return {"total": total, "n_would_clip": would_clip, **{f"n_{q}": n[q] for q in n}, **{f"share_{q}": (w[q] / total if total else 0.0)
                                                               for q in w}}


@pytest.mark.parametrize("seed", range(6))
def test_m2po_quadrants_match_a_literal_loop(seed):
    lp, old, adv, mask = _batch(seed)
    loss, m = compute_policy_loss_m2po(old, lp, adv, mask, config={"m2_threshold": 0.02})
    assert list(m) == list(METRIC_KEYS)
    keep = select_m2po(torch.where(mask, lp - old, torch.zeros(())), adv, mask, 0.02).keep_mask
    ref = literal_quadrants(lp, old, adv, mask, (~keep).tolist())
    assert m["m2po/num_masked_pos_r_gt_1"] == ref["n_pos_r_gt_1"]
    assert m["m2po/num_masked_neg_r_lt_1"] == ref["n_neg_r_lt_1"]
    assert m["m2po/num_masked_pos_r_gt_1"] + m["m2po/num_masked_neg_r_lt_1"] == m["m2po/num_masked_tokens"]
    for q in ("pos_r_gt_1", "neg_r_lt_1"):
        assert m[f"m2po/masked_weight_share_{q}"] == pytest.approx(ref[f"share_{q}"], rel=1e-5, abs=1e-9)
    assert m["m2po/num_masked_tokens"] > 0  # the data exercise the mask
    assert ref["n_would_clip"] > 0
    assert m["m2po/would_clip_fraction"] == pytest.approx(ref["n_would_clip"] / int(mask.sum()), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_m2pos_would_clip_fraction_is_what_clip_clips_on_the_same_tokens(seed):
    # The paper's masked-vs-clipped comparison on identical tokens: the tokens M2PO counts as "clip would zero these"
    # are exactly those the vanilla loss (PPO clip at its default eps 0.2) clips.
    lp, old, adv, mask = _batch(seed)
    _, m = compute_policy_loss_m2po(old, lp, adv, mask, config={"m2_threshold": 0.04})
    _, v = compute_policy_loss_vanilla(old, lp, adv, mask)
    assert v["vanilla/clip_fraction"] > 0
    assert m["m2po/would_clip_fraction"] == pytest.approx(v["vanilla/clip_fraction"], rel=1e-6)


def test_m2po_quadrants_on_a_hand_made_case():
    # T = {0 (A>0, d=0.1), 1 (A>0, d=1.0), 2 (A<0, d=-2.0)}; token 3 is outside T (A<0, d>0)
    d = torch.tensor([[0.1, 1.0, -2.0, 0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones_like(d, dtype=torch.bool)
    _, m = compute_policy_loss_m2po(torch.zeros_like(d), d, adv, mask, config={"m2_threshold": 0.04})
    # Algorithm 1 masks d^2 = 4 first (mean of {0.01, 1} is 0.505 > tau), then 1.0: only token 0 stays
    assert m["m2po/num_masked_tokens"] == 2
    assert (m["m2po/num_masked_pos_r_gt_1"], m["m2po/num_masked_neg_r_lt_1"]) == (1, 1)
    total = math.exp(0.1) + math.exp(1.0) + math.exp(-2.0)
    assert m["m2po/masked_weight_share_pos_r_gt_1"] == pytest.approx(math.exp(1.0) / total, rel=1e-6)
    assert m["m2po/masked_weight_share_neg_r_lt_1"] == pytest.approx(math.exp(-2.0) / total, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_clip_quadrants_match_a_literal_loop(seed):
    lp, old, adv, mask = _batch(seed)
    cfg = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    _, m = compute_policy_loss_vanilla(old, lp, adv, mask, config=cfg)
    assert list(m) == list(VANILLA_METRIC_KEYS)
    clipped = [[bool(mask[i, j]) and ((float(adv[i, j]) > 0 and math.exp(float(lp[i, j] - old[i, j])) > 1.28)
                                      or (float(adv[i, j]) < 0 and math.exp(float(lp[i, j] - old[i, j])) < 0.8))
                for j in range(mask.shape[1])] for i in range(mask.shape[0])]
    ref = literal_quadrants(lp, old, adv, mask, clipped)
    n_valid = int(mask.sum())
    assert m["vanilla/num_clipped_pos_r_gt_1"] == ref["n_pos_r_gt_1"]
    assert m["vanilla/num_clipped_neg_r_lt_1"] == ref["n_neg_r_lt_1"]
    assert (m["vanilla/num_clipped_pos_r_gt_1"] + m["vanilla/num_clipped_neg_r_lt_1"]) / n_valid == pytest.approx(
        m["vanilla/clip_fraction"], rel=1e-6)
    assert m["vanilla/trust_region_weight_per_token"] == pytest.approx(ref["total"] / n_valid, rel=1e-5)
    for q in ("pos_r_gt_1", "neg_r_lt_1"):
        assert m[f"vanilla/clipped_weight_share_{q}"] == pytest.approx(ref[f"share_{q}"], rel=1e-5, abs=1e-9)
        assert m[f"vanilla/clipped_weight_per_token_{q}"] == pytest.approx(ref[f"share_{q}"] * ref["total"] / n_valid,
                                                                           rel=1e-5, abs=1e-9)
    assert ref["n_pos_r_gt_1"] > 0 and ref["n_neg_r_lt_1"] > 0


# --------------------------------------------------------------------------------------- loss and gradient unchanged
def _m2po_as_before(old, lp, adv, response_mask, tau):
    """The M2PO loss exactly as written before the diagnostics (same ops, same order)."""
    valid = check_inputs("m2po", old, lp, adv, response_mask)
    d = masked_log_ratio(old, lp, valid)
    keep = select_m2po(d, adv, valid, tau).keep_mask & valid
    a = torch.where(valid, adv.detach().float(), torch.zeros((), device=valid.device))
    ratio = torch.exp(clamp_log_ratio(d))
    per_token = torch.where(keep, -a * ratio, torch.zeros_like(ratio))
    return agg_loss(per_token, valid, "token-mean")


def _vanilla_as_before(old, lp, adv, response_mask):
    valid = check_inputs("vanilla", old, lp, adv, response_mask)
    d = masked_log_ratio(old, lp, valid)
    a = torch.where(valid, adv.detach().float(), torch.zeros((), device=valid.device))
    ratio = torch.exp(clamp_log_ratio(d))
    per_token, _, _ = ppo_clip_surrogate(ratio, a, 0.2, 0.2, None)
    return agg_loss(per_token, valid, "token-mean")


@pytest.mark.parametrize("seed", range(4))
def test_loss_and_gradient_are_bit_identical_to_the_loss_without_diagnostics(seed):
    lp, old, adv, mask = _batch(seed)
    for ours, before in ((lambda x: compute_policy_loss_m2po(old, x, adv, mask, config={"m2_threshold": 0.04})[0],
                          lambda x: _m2po_as_before(old, x, adv, mask, 0.04)),
                         (lambda x: compute_policy_loss_vanilla(old, x, adv, mask)[0],
                          lambda x: _vanilla_as_before(old, x, adv, mask))):
        x1, x2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        l1, l2 = ours(x1), before(x2)
        l1.backward()
        l2.backward()
        assert torch.equal(l1, l2)
        assert torch.equal(torch.nan_to_num(x1.grad), torch.nan_to_num(x2.grad))


# --------------------------------------------------------------------------------------------- split invariance
def _micro_batches(lp, old, adv, mask, per_mb):
    return [MicroBatch(old[i:i + per_mb], lp[i:i + per_mb], adv[i:i + per_mb], mask[i:i + per_mb])
            for i in range(0, mask.shape[0], per_mb)]


@pytest.mark.parametrize("seed", range(3))
def test_m2po_quadrants_of_a_split_step_are_the_whole_steps(seed):
    lp, old, adv, mask = _batch(seed)
    cfg = {"m2_threshold": 0.02}
    _, whole = compute_policy_loss_m2po(old, lp, adv, mask, config=cfg)
    for per_mb in (1, 3, 8):
        plan = plan_optimizer_batch("m2po", _micro_batches(lp, old, adv, mask, per_mb), cfg)
        got = plan.selection.metrics()
        assert list(got) == list(METRIC_KEYS)
        for key in QUADRANT_METRIC_KEYS:
            assert got[key] == pytest.approx(whole[key], rel=1e-9, abs=1e-12), (per_mb, key)


def test_clip_per_token_weights_combine_exactly_over_micro_batches():
    lp, old, adv, mask = _batch(11)
    _, whole = compute_policy_loss_vanilla(old, lp, adv, mask)
    parts = []
    for mb in _micro_batches(lp, old, adv, mask, 3):
        _, m = compute_policy_loss_vanilla(mb.old_log_prob, mb.log_prob, mb.advantages, mb.response_mask)
        parts.append((float(mb.response_mask.sum()), m))
    n = sum(w for w, _ in parts)
    combined = {k: sum(w * m[k] for w, m in parts) / n for k in parts[0][1]}  # the runtime's token weighting
    for q in ("pos_r_gt_1", "neg_r_lt_1"):
        share = combined[f"vanilla/clipped_weight_per_token_{q}"] / combined["vanilla/trust_region_weight_per_token"]
        assert share == pytest.approx(whole[f"vanilla/clipped_weight_share_{q}"], rel=1e-6)


def test_runtime_micro_batches_report_the_whole_mini_batchs_quadrants(tiny_policy):
    from stalerl.config import NormConfig, load_config
    from stalerl.core.model import PromptFormatter
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.training.actor import Actor
    from stalerl.training.advantage import grpo_advantages

    model, tok = tiny_policy
    torch.manual_seed(5)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = HFRolloutEngine(behaviour, tok, PromptFormatter(tok).format, gsm8k_reward)
    batch = engine.generate(["12+7=?", "3+45=?", "99+1=?", "8+8=?"], ["19", "48", "100", "16"], n_samples=4,
                            max_new_tokens=8)
    batch.rewards = (torch.rand(batch.num_rows) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())

    def metrics(max_tokens):
        cfg = load_config(["actor.loss=m2po", "actor.m2_threshold=0.01", f"actor.mb_spec.max_tokens_per_mb={max_tokens}"])
        return Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=1).update(batch, adv)

    whole, split = metrics(100000), metrics(40)
    assert whole["actor/num_micro_batches"] == 1 and split["actor/num_micro_batches"] > 3
    assert whole["actor/m2po/num_masked_tokens"] > 0
    for key in QUADRANT_METRIC_KEYS:
        assert split[f"actor/{key}"] == pytest.approx(whole[f"actor/{key}"], rel=1e-6, abs=1e-12), key
