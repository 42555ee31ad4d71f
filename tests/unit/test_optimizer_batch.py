"""recipe.optimizer_batch: a step split into micro-batches of any shapes gives the one-call loss and the literal mask."""

from __future__ import annotations

import pytest
import torch

from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch, with_global_batch_info
from recipe.registry import get_policy_loss_fn
from m2po_reference import reference_m2po


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
