"""recipe.optimizer_batch: a step split into micro-batches of any shapes gives the one-call loss and the literal mask
(M2PO's Algorithm 1 selection; FIPO's sequence drop, also where rows drop)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch, with_global_batch_info
from recipe.registry import get_policy_loss_fn
from m2po_reference import reference_m2po

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fipo_reference import fipo_loop  # noqa: E402


def _rows(n_rows: int, width: int, gen: torch.Generator) -> list[MicroBatch]:
    """One batch of rows of uneven valid length, as a list of single-row micro-batches (width = padded length)."""
    rows = []
    for _ in range(n_rows):
        length = int(torch.randint(1, width + 1, (1,), generator=gen))
        mask = torch.zeros(1, width, dtype=torch.bool)
        mask[0, :length] = True
        old = -torch.rand(1, width, generator=gen) * 3
        new = old + torch.randn(1, width, generator=gen) * 0.4
        adv = torch.randn(1, 1, generator=gen).expand(1, width).clone()
        rows.append(MicroBatch(old, new, adv, mask))
    return rows


def _group(rows: list[MicroBatch], per_mb: int) -> list[MicroBatch]:
    """Concatenate consecutive rows into micro-batches, each trimmed to its own longest row (as TRL pads)."""
    out = []
    for i in range(0, len(rows), per_mb):
        part = rows[i:i + per_mb]
        width = max(int(r.response_mask.sum()) for r in part)
        out.append(MicroBatch(*[torch.cat([getattr(r, k)[:, :width] for r in part])
                                for k in ("old_log_prob", "log_prob", "advantages", "response_mask")]))
    return out


@pytest.mark.parametrize("loss_name", ["m2po", "fipo", "vanilla", "no_trust_region"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_losses_sum_to_the_one_call_loss(loss_name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = _rows(8, 12, gen)
    whole = _group(rows, 8)[0]
    fn = get_policy_loss_fn(loss_name)
    config = {"m2_threshold": 0.04}
    expected, _ = fn(old_log_prob=whole.old_log_prob, log_prob=whole.log_prob, advantages=whole.advantages,
                     response_mask=whole.response_mask, loss_agg_mode="token-mean", config=config)
    for per_mb in (1, 2, 4):
        mbs = _group(rows, per_mb)
        plan = plan_optimizer_batch(loss_name, mbs, config)
        assert plan.num_tokens == int(whole.response_mask.sum())
        total = sum(fn(old_log_prob=mb.old_log_prob, log_prob=mb.log_prob, advantages=mb.advantages,
                       response_mask=mb.response_mask, loss_agg_mode="token-mean", config=plan.config_for(config),
                       **extras)[0]
                    for mb, extras in zip(mbs, plan.extras))
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-7)


def test_m2po_keep_mask_is_the_literal_algorithm_1_mask_of_the_whole_step() -> None:
    gen = torch.Generator().manual_seed(7)
    rows = _rows(16, 10, gen)
    whole = _group(rows, 16)[0]
    d = (whole.log_prob - whole.old_log_prob).float()
    literal = reference_m2po(d.tolist(), whole.advantages.tolist(), whole.response_mask.tolist(), 0.04)
    expected = torch.tensor(literal["keep"], dtype=torch.bool)
    mbs = _group(rows, 4)
    plan = plan_optimizer_batch("m2po", mbs, {"m2_threshold": 0.04})
    assert plan.selection is not None and plan.selection.num_valid == int(whole.response_mask.sum())
    got = [extras["keep_mask"] for extras in plan.extras]
    for mb, mask in zip(mbs, got):
        assert mask.shape == mb.response_mask.shape
    # Compare row by row on valid tokens (the micro-batches are trimmed to different widths).
    flat_got = torch.cat([m[mb.response_mask] for m, mb in zip(got, mbs)])
    flat_expected = expected.bool()[whole.response_mask]
    assert torch.equal(flat_got, flat_expected)
    assert (~flat_expected).any(), "the test data must make Algorithm 1 mask something"


def test_packed_one_dimensional_micro_batches_are_accepted() -> None:
    gen = torch.Generator().manual_seed(3)
    mbs = [MicroBatch(*(t.reshape(-1) for t in (mb.old_log_prob, mb.log_prob, mb.advantages, mb.response_mask)))
           for mb in _group(_rows(6, 9, gen), 3)]
    plan = plan_optimizer_batch("m2po", mbs, {"m2_threshold": 0.04})
    assert [e["keep_mask"].shape for e in plan.extras] == [mb.response_mask.shape for mb in mbs]


def test_bad_micro_batches_fail_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="at least one micro-batch"):
        plan_optimizer_batch("m2po", [])
    with pytest.raises(ValueError, match="share one shape"):
        MicroBatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))


def test_with_global_batch_info_keeps_the_callers_config() -> None:
    base = {"m2_threshold": 0.1, "global_batch_info": {"global_batch_size": 4}}
    cfg = with_global_batch_info(base, num_tokens=37, dp_size=2)
    assert cfg["m2_threshold"] == 0.1
    assert cfg["global_batch_info"] == {"global_batch_size": 4, "batch_num_tokens": 37, "dp_size": 2}
    assert base["global_batch_info"] == {"global_batch_size": 4}


# ------------------------------------------------------------------------------ FIPO: rows that drop


FIPO_CFG = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


def _fipo_rows(n_rows: int, width: int, gen: torch.Generator, *, drop_every: int = 3) -> list[MicroBatch]:
    """Rows of uneven length whose ratios drift; every ``drop_every``-th row has A < 0 and two tokens of ratio
    > c = 10 (FIPO drops it), some other rows one such token (kept, dual-clipped)."""
    rows = _rows(n_rows, width, gen)
    for i, r in enumerate(rows):
        length = int(r.response_mask.sum())
        if i % drop_every == 0 and length >= 2:
            r.advantages.fill_(-abs(float(r.advantages[0, 0])) - 0.1)
            r.log_prob[0, :2] = r.old_log_prob[0, :2] + 3.0
        elif i % drop_every == 1 and length >= 1:
            r.advantages.fill_(-0.5)
            r.log_prob[0, length - 1] = r.old_log_prob[0, length - 1] + 3.0
    return rows


def _literal_fipo(mb: MicroBatch) -> float:
    loss, _, _, _ = fipo_loop(mb.old_log_prob, mb.log_prob, mb.advantages, mb.response_mask, eps_low=0.2,
                              eps_high=0.28)
    return loss


def test_issue_27_example_one_dropped_row_of_four_split_equals_fipo_alone() -> None:
    """The issue's case: four rows of 10 tokens, one dropped. ``fipo`` alone divides by the 30 kept tokens; a split
    step used to divide by all 40 (x 30/40). The plan now counts the kept tokens and hands each call its drop."""
    gen = torch.Generator().manual_seed(27)
    rows = []
    for i in range(4):
        old = -torch.rand(1, 10, generator=gen) * 2
        new = old + torch.randn(1, 10, generator=gen) * 0.3
        adv = torch.full((1, 10), [1.0, -1.0, 0.5, -0.7][i])
        rows.append(MicroBatch(old, new, adv, torch.ones(1, 10, dtype=torch.bool)))
    rows[1].log_prob[0, [2, 6]] = rows[1].old_log_prob[0, [2, 6]] + 3.0  # row 1 (A < 0): two ratios > 10
    whole = _group(rows, 4)[0]
    fn = get_policy_loss_fn("fipo")
    alone, metrics = fn(old_log_prob=whole.old_log_prob, log_prob=whole.log_prob, advantages=whole.advantages,
                        response_mask=whole.response_mask, loss_agg_mode="token-mean", config=FIPO_CFG)
    assert metrics["fipo/sequence_drop_ratio"] == 0.25
    assert alone.item() == pytest.approx(_literal_fipo(whole), rel=1e-6)
    mbs = _group(rows, 2)
    plan = plan_optimizer_batch("fipo", mbs, FIPO_CFG)
    assert plan.num_tokens == 30 and plan.row_drops.num_valid_tokens == 40
    assert plan.selection is None  # callers that read `selection` as M2PO's see nothing new
    assert plan.row_drops.metrics()["fipo/sequence_drop_ratio"] == 0.25
    split = sum(fn(old_log_prob=mb.old_log_prob, log_prob=mb.log_prob, advantages=mb.advantages,
                   response_mask=mb.response_mask, loss_agg_mode="token-mean", config=plan.config_for(FIPO_CFG),
                   **extras)[0] for mb, extras in zip(mbs, plan.extras))
    torch.testing.assert_close(split, alone, rtol=1e-6, atol=1e-7)
    # what the issue measured, the all-valid-tokens count without the plan's drop (the reference x 30/40), is now
    # refused by the loss itself: it cannot be exact with that count (issue 37 item 2)
    with pytest.raises(ValueError, match="plan_optimizer_batch"):
        sum(fn(old_log_prob=mb.old_log_prob, log_prob=mb.log_prob, advantages=mb.advantages,
               response_mask=mb.response_mask, loss_agg_mode="token-mean",
               config=with_global_batch_info(FIPO_CFG, num_tokens=40))[0] for mb in mbs)


@pytest.mark.parametrize("seed", range(6))
def test_fipo_split_step_is_the_literal_reference_whenever_rows_drop(seed: int) -> None:
    """Any split by rows, each micro-batch padded to its own width: the summed losses and the gradient are the
    one-call FIPO loss, and the loss is the literal per-token loop's (tests/unit/fipo_reference.py)."""
    gen = torch.Generator().manual_seed(100 + seed)
    rows = _fipo_rows(12, 9, gen, drop_every=3 + seed % 2)
    whole = _group(rows, 12)[0]
    fn = get_policy_loss_fn("fipo")
    lp_whole = whole.log_prob.clone().requires_grad_(True)
    expected, metrics = fn(old_log_prob=whole.old_log_prob, log_prob=lp_whole, advantages=whole.advantages,
                           response_mask=whole.response_mask, loss_agg_mode="token-mean", config=FIPO_CFG)
    expected.backward()
    assert metrics["fipo/sequence_drop_ratio"] > 0, "the data must drop rows"
    assert expected.item() == pytest.approx(_literal_fipo(whole), rel=2e-5, abs=2e-6)
    for per_mb in (1, 2, 5, 12):
        mbs = _group(rows, per_mb)
        plan = plan_optimizer_batch("fipo", mbs, FIPO_CFG)
        assert plan.row_drops.num_dropped_rows == round(metrics["fipo/sequence_drop_ratio"] * 12)
        total, grads = 0.0, []
        for mb, extras in zip(mbs, plan.extras):
            lp = mb.log_prob.clone().requires_grad_(True)
            loss, _ = fn(old_log_prob=mb.old_log_prob, log_prob=lp, advantages=mb.advantages,
                         response_mask=mb.response_mask, loss_agg_mode="token-mean",
                         config=plan.config_for(FIPO_CFG), **extras)
            loss.backward()
            total = total + loss.detach()
            grads.append(lp.grad)
        torch.testing.assert_close(total, expected.detach(), rtol=1e-6, atol=1e-7)
        got = torch.cat([g[mb.response_mask] for g, mb in zip(grads, mbs)])
        torch.testing.assert_close(got, lp_whole.grad[whole.response_mask], rtol=1e-6, atol=1e-8)


def test_fipo_plan_on_packed_micro_batches_with_cu_seqlens_drops_the_same_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = _fipo_rows(9, 8, gen)
    padded = _group(rows, 3)
    packed = []
    for mb in padded:
        m = mb.response_mask
        lengths = m.sum(1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        packed.append(MicroBatch(*(t[m] for t in (mb.old_log_prob, mb.log_prob, mb.advantages)),
                                 torch.ones(int(lengths.sum()), dtype=torch.bool), cu_seqlens=cu))
    plan_padded = plan_optimizer_batch("fipo", padded, FIPO_CFG)
    plan_packed = plan_optimizer_batch("fipo", packed, FIPO_CFG)
    assert plan_padded.row_drops.num_dropped_rows > 0
    assert plan_packed.row_drops == plan_padded.row_drops and plan_packed.num_tokens == plan_padded.num_tokens
    for ep, ed, mb in zip(plan_packed.extras, plan_padded.extras, padded):
        assert ep["row_keep_mask"].shape == (int(mb.response_mask.sum()),)
        assert torch.equal(ep["row_keep_mask"], ed["row_keep_mask"][mb.response_mask])
    # without the boundaries a packed micro-batch would be one long row: refused
    with pytest.raises(ValueError, match="set MicroBatch.cu_seqlens"):
        plan_optimizer_batch("fipo", [MicroBatch(*(t.reshape(-1) for t in (
            padded[0].old_log_prob, padded[0].log_prob, padded[0].advantages, padded[0].response_mask)))], FIPO_CFG)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        plan_optimizer_batch("fipo", [MicroBatch(packed[0].old_log_prob, packed[0].log_prob, packed[0].advantages,
                                                 packed[0].response_mask, cu_seqlens=torch.tensor([0, 5, 3]))],
                             FIPO_CFG)
    with pytest.raises(ValueError, match="cu_seqlens marks sequences in packed tokens"):
        MicroBatch(*(getattr(padded[0], k) for k in ("old_log_prob", "log_prob", "advantages", "response_mask")),
                   cu_seqlens=torch.tensor([0, 1]))


def test_fipo_loss_refuses_a_keep_mask_that_splits_a_row() -> None:
    gen = torch.Generator().manual_seed(9)
    mb = _group(_fipo_rows(4, 6, gen), 4)[0]
    keep = mb.response_mask.clone()
    keep[0, 0] = False  # an M2PO-style token mask: part of a row
    with pytest.raises(ValueError, match="keeps only part of 1 row"):
        get_policy_loss_fn("fipo")(old_log_prob=mb.old_log_prob, log_prob=mb.log_prob, advantages=mb.advantages,
                                   response_mask=mb.response_mask, config=FIPO_CFG, row_keep_mask=keep)


def test_fipo_plan_over_two_gloo_ranks_counts_the_kept_tokens_of_every_rank(tmp_path) -> None:
    """Two processes, uneven micro-batches: the averaged rank losses are the one-call loss over both ranks' rows."""
    import torch.multiprocessing as mp

    import fipo_dist_worker

    mp.spawn(fipo_dist_worker.run_rank, args=(2, str(tmp_path)), nprocs=2, join=True)
    case = fipo_dist_worker.make_case()
    whole = fipo_dist_worker.whole_batch(case)
    expected, _ = get_policy_loss_fn("fipo")(old_log_prob=whole.old_log_prob, log_prob=whole.log_prob,
                                             advantages=whole.advantages, response_mask=whole.response_mask,
                                             loss_agg_mode="token-mean", config=fipo_dist_worker.CFG)
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert outs[0]["num_tokens"] == outs[1]["num_tokens"] < int(whole.response_mask.sum())
    assert outs[0]["dropped"] == outs[1]["dropped"] > 0
    total = (outs[0]["loss"] + outs[1]["loss"]) / 2  # data-parallel gradients are averaged over ranks
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-7)
