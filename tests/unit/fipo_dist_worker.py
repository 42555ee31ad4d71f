"""Worker for the two-process gloo test of FIPO's step plan (tests/unit/test_optimizer_batch.py).

Kept out of the test module so that the spawned processes import only torch and recipe.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch
from recipe.registry import get_policy_loss_fn

CFG = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


def _rows(g: torch.Generator, lengths: list[int], width: int, drops: list[int]) -> MicroBatch:
    n = len(lengths)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).reshape(n, 1)
    old = -torch.rand(n, width, generator=g) * 2
    new = old + torch.randn(n, width, generator=g) * 0.4
    adv = torch.randn(n, 1, generator=g).expand(n, width).clone()
    for i in drops:  # A < 0 and two ratios > c = 10: FIPO drops the row
        adv[i] = -1.0
        new[i, :2] = old[i, :2] + 3.0
    return MicroBatch(old, new, adv, mask)


def make_case() -> list[list[MicroBatch]]:
    """Per rank, its micro-batches (rank 0: two, rank 1: one; different widths)."""
    g = torch.Generator().manual_seed(2727)
    return [[_rows(g, [7, 3, 5], 7, [1]), _rows(g, [4, 4], 4, [])], [_rows(g, [6, 2, 6, 5], 6, [0, 3])]]


def whole_batch(case: list[list[MicroBatch]]) -> MicroBatch:
    mbs = [mb for rank in case for mb in rank]
    width = max(mb.response_mask.shape[1] for mb in mbs)

    def cat(name: str) -> torch.Tensor:
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
        return torch.cat([pad(getattr(mb, name)) for mb in mbs])

    return MicroBatch(cat("old_log_prob"), cat("log_prob"), cat("advantages"), cat("response_mask"))


def run_rank(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        mbs = make_case()[rank]
        plan = plan_optimizer_batch("fipo", mbs, CFG, group=dist.group.WORLD)
        fn = get_policy_loss_fn("fipo")
        loss = sum(fn(old_log_prob=mb.old_log_prob, log_prob=mb.log_prob, advantages=mb.advantages,
                      response_mask=mb.response_mask, loss_agg_mode="token-mean", config=plan.config_for(CFG),
                      **extras)[0] for mb, extras in zip(mbs, plan.extras))
        torch.save({"loss": loss.detach(), "num_tokens": plan.num_tokens,
                    "dropped": plan.row_drops.num_dropped_rows}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
