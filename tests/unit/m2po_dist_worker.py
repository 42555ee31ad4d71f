"""Worker for the two-process gloo test of M2PO's cross-rank selection (tests/unit/test_m2po_algorithm.py).

Kept out of the test module so that the spawned processes import only torch and recipe.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import recipe.m2po.algorithm as algo
from recipe.m2po import compute_policy_loss_m2po, m2po_batch_selector, select_m2po

NUM_FEATURES = 3


def _part(g: torch.Generator, lengths: list[int], width: int) -> dict:
    rows = len(lengths)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths, dtype=torch.int64).reshape(rows, 1)
    old = -torch.rand(rows, width, generator=g) * 2
    d = torch.randint(-5, 6, (rows, width), generator=g).float() / 16  # quantised: ties inside and across ranks
    tail = torch.rand(rows, width, generator=g) < 0.15
    d = torch.where(tail, d * 8, d)
    choices = torch.tensor([-1.5, -1.0, 0.0, 0.5, 1.0])
    adv = choices[torch.randint(0, len(choices), (rows, 1), generator=g)].expand(rows, width).clone()
    feats = torch.randn(rows, width, NUM_FEATURES, generator=g)
    nan, inf = float("nan"), float("inf")
    return {
        "lp_base": torch.where(mask, old + d, torch.full_like(old, nan)),  # garbage on padding
        "old": torch.where(mask, old, torch.full_like(old, inf)),
        "adv": torch.where(mask, adv, torch.full_like(adv, nan)),
        "mask": mask,
        "feats": torch.where(mask.unsqueeze(-1), feats, torch.zeros_like(feats)),
    }


def _tied_part(g: torch.Generator, rows: int, width: int) -> dict:
    """Every row: 2 tokens of d ~ 0.5 (d^2 ~ 0.25), the rest d ~ 0.1 (0.01), A = 1: at tau 0.04 two such ranks of 5
    rows of width 12 keep 14 of their 20 tied tokens, so the boundary falls inside rank 1's ties."""
    d = torch.full((rows, width), 0.1)
    d[:, :2] = 0.5
    old = -torch.rand(rows, width, generator=g) * 2
    mask = torch.ones(rows, width, dtype=torch.bool)
    return {"lp_base": old + d, "old": old, "adv": torch.ones(rows, width), "mask": mask,
            "feats": torch.randn(rows, width, NUM_FEATURES, generator=g)}


def make_case(name: str) -> dict:
    g = torch.Generator().manual_seed(1234)
    if name == "uneven":  # different widths, rows and valid-token counts per rank
        ranks = [_part(g, [9, 5, 7, 0], 9), _part(g, [6, 2, 4], 6)]
    elif name == "rank1_empty":  # rank 1 holds rows but no valid token
        ranks = [_part(g, [10, 8, 3, 10, 6], 10), _part(g, [0, 0], 3)]
    elif name == "ties_across_ranks":  # the tie rule across ranks: rank 0's tied tokens come first
        ranks = [_tied_part(g, 5, 12), _tied_part(g, 5, 12)]
    else:
        raise ValueError(name)
    return {"name": name, "ranks": ranks}


def run_rank(rank: int, world: int, out_dir: str, cases: list, tau: float) -> None:
    """Each case in turn, in one process group; writes ``<case name>_rank<rank>.pt`` to ``out_dir``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for case in cases:
            _run_case(rank, world, out_dir, case, tau)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_case(rank: int, world: int, out_dir: str, case: dict, tau: float) -> None:
    part = case["ranks"][rank]
    old, adv, mask = part["old"], part["adv"], part["mask"]
    n_global = sum(int(p["mask"].sum()) for p in case["ranks"])
    gbi = {"dp_size": world, "batch_num_tokens": n_global}
    out: dict = {}

    sel = select_m2po(part["lp_base"] - old, adv, mask, tau, group=dist.group.WORLD)
    out["selection"] = {"keep": sel.keep_mask, "num_valid": sel.num_valid,
                        "num_trust_region": sel.num_trust_region, "num_masked": sel.num_masked,
                        "m2_before": sel.m2_before, "m2_after": sel.m2_after}
    # the pass without compaction (a full-size key tensor), and the sort the radix select replaces
    full_size, radix = algo._FULL_SIZE_DEVICES, algo._radix_decision
    try:
        algo._FULL_SIZE_DEVICES = ("cpu",)
        out["selection_full_size"] = select_m2po(part["lp_base"] - old, adv, mask, tau,
                                                 group=dist.group.WORLD).keep_mask
        algo._FULL_SIZE_DEVICES = full_size

        def never_exact(*args, **kwargs):
            decision, exact = radix(*args, **kwargs)
            return decision, torch.zeros_like(exact)

        algo._radix_decision = never_exact
        out["selection_sort"] = select_m2po(part["lp_base"] - old, adv, mask, tau, group=dist.group.WORLD).keep_mask
    finally:
        algo._FULL_SIZE_DEVICES, algo._radix_decision = full_size, radix

    for method in ("selector", "dp_group"):
        theta = torch.zeros(NUM_FEATURES, requires_grad=True)
        lp = part["lp_base"] + part["feats"] @ theta
        lp.retain_grad()
        if method == "selector":
            keep = m2po_batch_selector(old, lp.detach(), adv, mask, config={"m2_threshold": tau},
                                       group=dist.group.WORLD)["keep_mask"]
            loss, metrics = compute_policy_loss_m2po(
                old, lp, adv, mask, config={"m2_threshold": tau, "global_batch_info": gbi}, keep_mask=keep)
        else:
            keep = None
            loss, metrics = compute_policy_loss_m2po(
                old, lp, adv, mask, config={"m2_threshold": tau, "m2_scope": "dp_group", "global_batch_info": gbi})
        loss.backward()
        grad = theta.grad.clone()
        dist.all_reduce(grad)
        grad /= world
        out[method] = {"keep": keep,  # None for dp_group: the loss does not return its mask
                       "loss": float(loss.item()), "lp_grad": lp.grad.clone(),
                       "theta_grad_avg": grad, "metrics": metrics}
    torch.save(out, os.path.join(out_dir, f"{case['name']}_rank{rank}.pt"))
