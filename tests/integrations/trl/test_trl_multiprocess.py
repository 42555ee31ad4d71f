"""recipe.trl with two processes (torch.distributed.run, gloo on CPU): M2PO's mask is Algorithm 1 over both
processes' micro-batches, the token count covers both, and 2 x (4x1) and 2 x (2x2) give the same weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _ports import TORCHRUN_STANDALONE
from trl_cases import REPO, require_trl

pytestmark = pytest.mark.trl
WORKER = Path(__file__).with_name("trl_dist_worker.py")
TAU = 0.2  # test_trl_grpo.SPLIT_TAU


def _launch(tmp_path: Path, per_device: int, ga: int) -> list[dict]:
    out = tmp_path / f"{per_device}x{ga}"
    # standalone: torchrun's agent binds its stores to ports the OS picks and holds them (tests/_ports.py)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *TORCHRUN_STANDALONE,
           str(WORKER), str(per_device), str(ga), str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return [torch.load(f"{out}_rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _steps(rank_data: dict) -> list[list[dict]]:
    windows = sorted({c["window"] for c in rank_data["calls"]})
    return [[c for c in rank_data["calls"] if c["window"] == w] for w in windows]


def test_two_processes_select_and_count_over_both(tmp_path: Path) -> None:
    require_trl()
    from m2po_reference import reference_m2po

    from recipe.registry import get_policy_loss_fn

    runs = {split: _launch(tmp_path, *split) for split in ((4, 1), (2, 2))}
    masked_total, differs_per_process = 0, False
    for ranks in runs.values():
        assert all(r["num_processes"] == 2 for r in ranks)
        w0, w1 = ranks[0]["weights"], ranks[1]["weights"]
        assert all(torch.equal(w0[k], w1[k]) for k in w0)
        for step in range(2):
            calls = [_steps(r)[step] for r in ranks]  # per rank: that step's micro-batch calls, in order
            flat = [c for per_rank in calls for c in per_rank]  # rank order, then micro-batch order

            def cat(key: str) -> torch.Tensor:
                return torch.cat([c[key] for c in flat])

            old, new, adv, mask = cat("old_log_prob"), cat("log_prob"), cat("advantages"), cat("response_mask")
            valid = mask.bool()
            assert all(c["config"]["global_batch_info"]["batch_num_tokens"] == int(valid.sum()) for c in flat)
            literal = torch.tensor(reference_m2po((new - old).float().tolist(), adv.tolist(), valid.tolist(),
                                                  TAU)["keep"])
            keep = torch.cat([c["extras"]["keep_mask"] for c in flat])
            assert torch.equal(keep[valid], literal[valid])
            masked_total += int((~literal[valid]).sum())
            # per process only, Algorithm 1 would keep other tokens: the check above can fail
            per_rank = []
            for rank_calls in calls:
                o, n, a, m = (torch.cat([c[k] for c in rank_calls])
                              for k in ("old_log_prob", "log_prob", "advantages", "response_mask"))
                per_rank += [x for row, mrow in zip(reference_m2po((n - o).float().tolist(), a.tolist(),
                                                                   m.bool().tolist(), TAU)["keep"], m.bool().tolist())
                             for x, v in zip(row, mrow) if v]
            differs_per_process |= per_rank != literal[valid].tolist()
            # DDP averages the ranks' gradients: the ranks' losses / 2 add up to the one-call loss of both
            whole, _ = get_policy_loss_fn("m2po")(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                                  loss_agg_mode="token-mean", config={"m2_threshold": TAU})
            torch.testing.assert_close(sum(c["loss"] for c in flat) / 2, whole, rtol=1e-5, atol=1e-7)
    assert masked_total > 0 and differs_per_process
    a, b = runs[(4, 1)][0]["weights"], runs[(2, 2)][0]["weights"]
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, f"2 x (4x1) and 2 x (2x2) differ by {worst}"
