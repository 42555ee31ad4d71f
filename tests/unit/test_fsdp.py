"""actor.backend=fsdp:d2 and the bucketed torch:d2 on two gloo processes against torch:d1 in this process: the same
updates (weights after each optimizer step, loss, grad norm, M2PO mask), the same continuation after a resume from
the gathered full state, and the gloo collectives FSDP2 relies on."""

from __future__ import annotations

import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalerl.training import fsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsdp_dist_worker  # noqa: E402

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(engine: str, out_dir, max_tokens_per_mb: int) -> dict:
    mp.spawn(fsdp_dist_worker.run_rank, args=(2, _port(), str(out_dir), engine, max_tokens_per_mb), nprocs=2, join=True)
    return torch.load(out_dir / f"{engine}.pt", weights_only=False)


KEYS = ("actor/loss", "actor/grad_norm", "actor/m2po/num_masked_tokens")  # global metrics (rank 0 reports them)


def _close(a: dict, b: dict, atol=2e-6, rtol=1e-4):
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=rtol), k


# 60 tokens per micro-batch gives the two ranks different micro-batch counts (the sharded forward is a collective,
# so the rank with fewer joins with empty passes); 100000 gives one micro-batch each.
@pytest.mark.parametrize("max_tokens_per_mb", [60, 100000])
def test_fsdp_d2_and_torch_d2_give_the_torch_d1_update_and_resume(tmp_path, max_tokens_per_mb):
    ref = fsdp_dist_worker.reference(max_tokens_per_mb)
    moved = max(float((ref["weights_1"][k] - ref["weights_2"][k]).abs().max()) for k in ref["weights_1"])
    assert moved > 1e-4  # the updates are real, so equality below means something
    for engine in ("fsdp", "torch"):
        got = _spawn(engine, tmp_path, max_tokens_per_mb)
        assert got["sharded"] == (engine == "fsdp")
        _close(got["weights_1"], ref["weights_1"])  # one optimizer step of AdamW over two mini-batches
        _close(got["weights_2"], ref["weights_2"])
        for mine, theirs in zip(got["metrics"], ref["metrics"]):
            for k in KEYS:
                assert mine[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), (engine, k)
        print(engine, "matches torch:d1")
        # Resumed from the state saved after update 1, update 2 lands on the uninterrupted run's weights.
        _close(got["weights_resumed"], ref["weights_2"])
        assert got["resumed_metrics"]["actor/lr"] == pytest.approx(ref["metrics"][1]["actor/lr"])
        if engine == "fsdp":
            assert got["state_keys"] == ["format", "lr_scheduler", "model", "optimizer"]
            # The sharded run's checkpoint resumes with the plain engine too (optimizer state keyed by name).
            plain = fsdp_dist_worker.resume_plain(got["state"], max_tokens_per_mb)
            _close(plain, ref["weights_2"])
        # Gradients (every tensor here has >= 64 elements; the counts and M2PO scalars have a few) go in one
        # flattened bucket per optimizer step for torch:d2 (before: one all-reduce per parameter tensor), and not
        # through all-reduce at all for fsdp:d2 (reduce-scatter inside FSDP2).
        big = [n for n in got["reduced"] if n >= 64]
        assert len(big) == (2 if engine == "torch" else 0), big


def _gloo_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.arange(4, dtype=dtype) + rank
        rs = torch.empty(2, dtype=dtype)
        dist.reduce_scatter_tensor(rs, x, op=dist.ReduceOp.AVG)
        ag = torch.empty(8, dtype=dtype)
        dist.all_gather_into_tensor(ag, x)
        results[str(dtype)] = (rs.float().tolist(), ag.float().tolist())
    # the bucketed all-reduce of the plain engine: tiny buckets force several calls, sizes differ per tensor
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 2)]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(rank + i))
    params[2].grad = None if rank == 1 else params[2].grad  # a rank without a gradient joins with zeros
    calls = fsdp.all_reduce_gradients(params, dist.group.WORLD, world, bucket_bytes=16)
    results["buckets"] = (calls, [p.grad.tolist() for p in params])
    torch.save(results, f"{out_dir}/gloo{rank}.pt")
    dist.barrier()  # tear down together (see fsdp_dist_worker.run_rank)
    dist.destroy_process_group()


def test_gloo_has_the_collectives_fsdp2_needs_and_buckets_average(tmp_path):
    mp.spawn(_gloo_rank, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"gloo{rank}.pt")
        for dtype in ("torch.float32", "torch.bfloat16"):
            rs, ag = r[dtype]
            assert rs == [[0.5, 1.5], [2.5, 3.5]][rank]  # mean over ranks of (x + rank), this rank's half
            assert ag == [0, 1, 2, 3, 1, 2, 3, 4]
        calls, grads = r["buckets"]
        assert calls == 2  # 12 + 20 bytes close the first bucket at 16 bytes; the 8-byte tensor makes the second
        assert grads == [[0.5] * 3, [1.5] * 5, [1.0] * 2]  # (r0 + r1) / 2; the missing grad counted as 0
