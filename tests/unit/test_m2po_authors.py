"""recipe.m2po_authors: the authors' adaptive-clip M2PO against a literal loop of their function, its relation to
Algorithm 1, split invariance in the optimizer-batch plan and the runtime, and its registration (opt-in only)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from m2po_authors_reference import reference_m2po_authors
from recipe.m2po import compute_policy_loss_m2po
from recipe.m2po_authors import METRIC_KEYS, compute_policy_loss_m2po_authors, solve_bound
from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch
from recipe.registry import BUILTIN_POLICY_LOSSES, get_batch_selector, get_policy_loss_fn


def _batch(seed: int, rows: int = 6, cols: int = 24, scale: float = 0.3, vary: bool = True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 2
    spread = float(torch.rand(1, generator=g) * 2 + 0.05) if vary else 1.0  # from well within to far over tau
    d = torch.randn(rows, cols, generator=g) * scale * spread
    tail = torch.rand(rows, cols, generator=g) < 0.06
    d = torch.where(tail, d * 6, d)
    lp = old + d
    adv = torch.randn(rows, 1, generator=g)
    adv[torch.rand(rows, 1, generator=g) < 0.2] = 0.0
    adv = adv.expand(rows, cols).clone()
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return lp, old, adv, mask


def _ours(lp, old, adv, mask, tau):
    x = lp.clone().requires_grad_()
    loss, m = compute_policy_loss_m2po_authors(old, x, adv, mask, config={"m2_threshold": tau})
    loss.backward()
    return loss, m, x.grad


@pytest.mark.parametrize("seed", range(120))
def test_matches_a_literal_loop_of_the_released_function(seed):
    lp, old, adv, mask = _batch(seed)
    tau = [0.0, 0.001, 0.01, 0.04, 0.2][seed % 5]
    d = torch.where(mask, lp - old, torch.zeros(()))
    ref = reference_m2po_authors(d.tolist(), adv.tolist(), mask.tolist(), tau)
    loss, m, grad = _ours(lp, old, adv, mask, tau)
    assert list(m) == list(METRIC_KEYS)
    bound = solve_bound(d, adv, mask, tau)
    assert (bound.low, bound.high) == (ref["low"], ref["high"])
    assert bound.num_trust_region == ref["num_trust_region"]
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    # the clipped tokens are exactly the valid tokens whose gradient is zero although A r != 0
    clipped = {(i, j) for i, j in zip(*torch.nonzero(mask & (grad == 0) & (adv != 0), as_tuple=True))}
    assert {(int(i), int(j)) for i, j in clipped} == set(ref["clipped"])
    assert m["m2po_authors/num_clipped_tokens"] == len(ref["clipped"])
    assert m["m2po_authors/m2_before"] == pytest.approx(ref["m2_before"], rel=1e-9, abs=1e-15)


def test_worked_examples_of_the_reference_document():
    # v = {0.001, 0.001, 0.1, 0.1}: Algorithm 1 masks one 0.1 (the rest has mean 0.034); the variant clips both
    d = torch.tensor([[math.sqrt(0.001), math.sqrt(0.001), math.sqrt(0.1), math.sqrt(0.1)]])
    adv, mask = torch.ones_like(d), torch.ones_like(d, dtype=torch.bool)
    old = torch.zeros_like(d)
    _, m2po = compute_policy_loss_m2po(old, d, adv, mask, config={"m2_threshold": 0.04})
    _, ours = compute_policy_loss_m2po_authors(old, d, adv, mask, config={"m2_threshold": 0.04})
    assert m2po["m2po/num_masked_tokens"] == 1
    assert ours["m2po_authors/num_clipped_tokens"] == 2
    assert ours["m2po_authors/log_ratio_bound"] == pytest.approx(math.sqrt(0.001), rel=1e-5)
    # {0.01, 0.04, 0.09}: both remove the 0.09
    d = torch.tensor([[0.1, 0.2, 0.3]])
    _, m2po = compute_policy_loss_m2po(torch.zeros_like(d), d, torch.ones_like(d), torch.ones_like(d).bool(),
                                       config={"m2_threshold": 0.04})
    _, ours = compute_policy_loss_m2po_authors(torch.zeros_like(d), d, torch.ones_like(d), torch.ones_like(d).bool(),
                                               config={"m2_threshold": 0.04})
    assert m2po["m2po/num_masked_tokens"] == ours["m2po_authors/num_clipped_tokens"] == 1


def test_budget_zero_clips_all_of_the_trust_region_instead_of_crashing():
    lp, old, adv, mask = _batch(3, vary=False)
    _, m, _ = _ours(lp, old, adv, mask, 0.0)
    assert m["m2po_authors/num_trust_region_tokens"] > 0
    assert m["m2po_authors/num_clipped_tokens"] == m["m2po_authors/num_trust_region_tokens"]
    assert m["m2po_authors/log_ratio_bound"] == 0.0


def test_within_budget_means_no_clipping():
    lp, old, adv, mask = _batch(4, scale=0.01, vary=False)
    _, m, _ = _ours(lp, old, adv, mask, 0.04)
    assert m["m2po_authors/m2_before"] <= 0.04
    assert m["m2po_authors/num_clipped_tokens"] == 0
    assert m["m2po_authors/log_ratio_bound"] == pytest.approx(math.log(1e5))


@pytest.mark.parametrize("seed", range(40))
def test_never_less_strict_than_algorithm_1(seed):
    lp, old, adv, mask = _batch(seed, scale=0.5, vary=False)
    tau = [0.01, 0.04, 0.1][seed % 3]
    _, m2po = compute_policy_loss_m2po(old, lp, adv, mask, config={"m2_threshold": tau})
    _, ours, _ = _ours(lp, old, adv, mask, tau)
    assert ours["m2po_authors/num_clipped_tokens"] >= m2po["m2po/num_masked_tokens"]


def _micro(lp, old, adv, mask, per_mb):
    return [MicroBatch(old[i:i + per_mb], lp[i:i + per_mb], adv[i:i + per_mb], mask[i:i + per_mb])
            for i in range(0, mask.shape[0], per_mb)]


@pytest.mark.parametrize("seed", range(4))
def test_split_step_gives_the_one_call_loss_gradient_and_metrics(seed):
    lp, old, adv, mask = _batch(seed, rows=8, vary=False)
    cfg = {"m2_threshold": 0.02}
    whole_loss, whole_m, whole_grad = _ours(lp, old, adv, mask, 0.02)
    assert whole_m["m2po_authors/num_clipped_tokens"] > 0
    fn = get_policy_loss_fn("m2po_authors")
    for per_mb in (1, 3, 8):
        x = lp.clone().requires_grad_()
        mbs = _micro(x, old, adv, mask, per_mb)
        plan = plan_optimizer_batch("m2po_authors", mbs, cfg)
        total = 0.0
        for mb, extras in zip(mbs, plan.extras):
            assert set(extras) == {"ratio_low", "ratio_high"}
            loss, _ = fn(old_log_prob=mb.old_log_prob, log_prob=mb.log_prob, advantages=mb.advantages,
                         response_mask=mb.response_mask, config=plan.config_for(cfg), **extras)
            loss.backward()
            total = total + loss
        torch.testing.assert_close(total, whole_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(x.grad, whole_grad, rtol=1e-6, atol=1e-8)
        got = plan.selection.metrics()
        assert list(got) == list(METRIC_KEYS)
        for key in METRIC_KEYS:
            assert got[key] == pytest.approx(whole_m[key], rel=1e-9, abs=1e-12), (per_mb, key)


def test_runtime_update_does_not_depend_on_the_micro_batch_split(tiny_policy):
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

    def update(max_tokens):
        cfg = load_config(["actor.loss=m2po_authors", "actor.m2_threshold=0.01", "actor.optimizer.type=sgd",
                           "actor.optimizer.lr=1.0", "actor.optimizer.gradient_clipping=1e9",
                           f"actor.mb_spec.max_tokens_per_mb={max_tokens}"])
        m = copy.deepcopy(model)
        metrics = Actor(m, cfg.actor, temperature=1.0, total_updates=1).update(batch, adv)
        return [p.detach().clone() for p in m.parameters()], metrics

    (whole, m_whole), (split, m_split) = update(100000), update(40)
    assert m_whole["actor/num_micro_batches"] == 1 and m_split["actor/num_micro_batches"] > 3
    assert m_whole["actor/m2po_authors/num_clipped_tokens"] > 0
    assert m_whole["actor/m2po_authors/num_clipped_tokens"] == m_split["actor/m2po_authors/num_clipped_tokens"]
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)


def test_registered_opt_in_never_the_default():
    from stalerl.config import load_config

    assert "m2po_authors" in BUILTIN_POLICY_LOSSES
    assert get_policy_loss_fn("m2po_authors") is compute_policy_loss_m2po_authors
    assert get_batch_selector("m2po_authors") is not None
    assert load_config([]).actor.loss == "m2po"
    assert load_config(["actor.loss=m2po_authors"]).actor.loss == "m2po_authors"


def test_bad_inputs_fail_with_one_line_naming_the_key():
    lp, old, adv, mask = _batch(0)
    with pytest.raises(ValueError, match="m2_threshold"):
        compute_policy_loss_m2po_authors(old, lp, adv, mask, config={"m2_threshold": -1.0})
    with pytest.raises(ValueError, match="ratio_low and ratio_high"):
        compute_policy_loss_m2po_authors(old, lp, adv, mask, ratio_low=torch.zeros_like(lp))
