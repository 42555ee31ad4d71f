"""actor.backend=fsdp:d2 and the bucketed torch:d2 on two gloo processes against torch:d1 in this process: the same
updates (weights after each optimizer step, loss, grad norm, M2PO mask), the same continuation after a resume from
the gathered full state, and the gloo collectives FSDP2 relies on."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalerl.training import fsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsdp_dist_worker  # noqa: E402
from _ports import held_store  # noqa: E402

pytestmark = pytest.mark.slow


def _spawn(engine: str, out_dir, max_tokens_per_mb: int) -> dict:
    store = held_store()  # held until both ranks are done (tests/_ports.py)
    mp.spawn(fsdp_dist_worker.run_rank, args=(2, store.port, str(out_dir), engine, max_tokens_per_mb), nprocs=2,
             join=True)
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
    fsdp_dist_worker.join_group(rank, world, port, 60)
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
    store = held_store()
    mp.spawn(_gloo_rank, args=(2, store.port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"gloo{rank}.pt")
        for dtype in ("torch.float32", "torch.bfloat16"):
            rs, ag = r[dtype]
            assert rs == [[0.5, 1.5], [2.5, 3.5]][rank]  # mean over ranks of (x + rank), this rank's half
            assert ag == [0, 1, 2, 3, 1, 2, 3, 4]
        calls, grads = r["buckets"]
        assert calls == 2  # 12 + 20 bytes close the first bucket at 16 bytes; the 8-byte tensor makes the second
        assert grads == [[0.5] * 3, [1.5] * 5, [1.0] * 2]  # (r0 + r1) / 2; the missing grad counted as 0


# ------------------------------------------------------------------------------------ bf16 (actor.dtype=bfloat16)
def _spawn_bf16(engine: str, out_dir, rows: int) -> dict:
    store = held_store()
    mp.spawn(fsdp_dist_worker.run_rank_bf16, args=(2, store.port, str(out_dir), engine), nprocs=2, join=True)
    parts = [torch.load(out_dir / f"bf16-{engine}-{r}.pt", weights_only=False) for r in (0, 1)]
    logp = torch.zeros((rows, max(p["logp"].shape[1] for p in parts)), dtype=torch.float32)
    for p in parts:  # each rank's on-policy log-probs of its own rows
        logp[p["rows"], :p["logp"].shape[1]] = p["logp"]
    return {**parts[0], "logp": logp}


def _log_ratio_stats(logp: torch.Tensor, batch) -> torch.Tensor:
    """Mean, second moment (M2) and max |.| of the on-policy log-ratio over valid tokens."""
    m = batch.response_mask
    d = torch.where(m, logp[:, :m.shape[1]] - batch.behavior_logp, torch.zeros(()))
    n = m.sum()
    return torch.stack([d.sum() / n, (d * d).sum() / n, d.abs().max()]).double()


def _update_difference(got: dict, ref: dict, key: str) -> float:
    """|| update(got) - update(ref) || / || update(ref) || over all parameters (SGD: update = -lr x gradient)."""
    num = sum(float(((got[key][n] - ref[key][n]).double() ** 2).sum()) for n in ref[key])
    den = sum(float(((ref[key][n] - ref["weights_0"][n]).double() ** 2).sum()) for n in ref[key])
    return (num / den) ** 0.5


def _second_update_difference(got: dict, restart: dict) -> float:
    """|| weights_2(got) - weights_2(restart) || / || weights_2(restart) - weights_1(got) ||: two second updates
    that started from the same weights (``restart`` loaded ``got``'s weights_1 before its second update)."""
    num = sum(float(((got["weights_2"][n] - restart["weights_2"][n]).double() ** 2).sum()) for n in restart["weights_2"])
    den = sum(float(((restart["weights_2"][n] - got["weights_1"][n]).double() ** 2).sum()) for n in restart["weights_2"])
    return (num / den) ** 0.5


# Tolerances. The three engines run the same bf16 operations on the same fp32 master weights (fsdp: linear groups
# all-gathered in bf16 = autocast's cast; norms, embeddings, residual stream fp32), so the on-policy log-probs agree
# to float rounding of the statistics (1e-6) and the gradients differ only in the order of the fp32 sums over ranks
# and micro-batches and the clip-norm reduction: k partial sums add at most k * 2^-24 relative error, k <= 8 here,
# i.e. <= 5e-7 of the update; UPDATE_TOL leaves 20x margin. A computation that differs in one bf16 rounding per op
# in the residual stream is far outside it: bf16 vs fp32 compute differ by ~7e-3 of the update here, and the old
# all-parameters-bf16 FSDP policy (checked below) by ~9e-3.
#
# That claim is per update, from the same weights: UPDATE_TOL applies to the first update (all engines start from
# the same weights) and to the second update restarted from the engine's own weights_1. It does not hold for the
# trajectory (weights_2 against the reference's weights_2), on any instruction set: the first updates differ by
# fp32 rounding of those sums (here 16-34 of 558,464 weights by one ulp), and a bf16 step amplifies weight
# differences of one ulp: a weight or activation near a bf16 rounding boundary is cast to the neighbouring bf16
# value (2^-8 away), and everything downstream follows. Measured here (AMD EPYC, AVX2): every weight moved up by
# one fp32 ulp before the second update moves weights_2 by 2.4e-3 of the two updates (1.7e-3 for random up/down;
# 1% of the weights at random: 1.3e-5), and a bf16 GEMM with another, equally valid, fp32 accumulation order (an
# emulation of a kernel chosen by ISA or shape) changes the first update itself by 1.5e-3. So how far the two
# trajectories drift depends on how many weights the first update left an ulp apart, which depends on the kernels:
# 1.8e-7 here, 5.7e-4 on an AVX512-BF16 Xeon (issue 28; its first update still agreed within UPDATE_TOL).
# TRAJECTORY_TOL bounds that drift (the one-ulp-everywhere case with 1.7x margin). It is a sanity bound, not a
# test of "the same computation": that drift is the bf16 noise floor, and fp32 compute is only 5.2e-3 away from
# bf16 here; the discriminating checks are the per-update ones at UPDATE_TOL.
STATS_TOL = 1e-6
UPDATE_TOL = 1e-5
TRAJECTORY_TOL = 4e-3


def test_bf16_fsdp_d2_torch_d2_and_torch_d1_compute_the_same(tmp_path):
    ref = fsdp_dist_worker.reference_bf16()
    ref_stats = _log_ratio_stats(ref["logp"], ref["batch"])
    assert 0 < float(ref_stats[2]) < 0.01  # bf16 engine noise (KV-cache generation vs one forward), not 0
    fp32 = fsdp_dist_worker.reference_bf16("float32")
    assert _update_difference(fp32, ref, "weights_1") > 100 * UPDATE_TOL  # bf16 really ran, and the test can see it
    rows = ref["batch"].num_rows
    for engine in ("fsdp", "torch"):
        got = _spawn_bf16(engine, tmp_path, rows)
        torch.testing.assert_close(got["logp"], ref["logp"], rtol=0, atol=STATS_TOL)
        torch.testing.assert_close(_log_ratio_stats(got["logp"], ref["batch"]), ref_stats, rtol=0, atol=STATS_TOL)
        assert _update_difference(got, ref, "weights_1") < UPDATE_TOL, (engine, _update_difference(got, ref, "weights_1"))
        restart = fsdp_dist_worker.reference_bf16(second_update_from=got["weights_1"])
        second = _second_update_difference(got, restart)
        assert second < UPDATE_TOL, (engine, "second update from the same weights", second)
        assert _update_difference(got, ref, "weights_2") < TRAJECTORY_TOL, (engine, _update_difference(got, ref, "weights_2"))
        for mine, theirs in ((got["metrics"][0], ref["metrics"][0]), (got["metrics"][1], restart["metrics"][1])):
            for k in ("actor/loss", "actor/grad_norm"):
                assert mine[k] == pytest.approx(theirs[k], rel=1e-5), (engine, k)
        if engine == "fsdp":  # what the sharded forward saw: bf16 projections, fp32 norms, embeddings and head
            seen = got["seen"]
            assert {n for n, d in seen.items() if d == "torch.bfloat16"} == {
                f"model.layers.{i}.{m}" for i in (0, 1) for m in (
                    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
            assert seen["model.embed_tokens"] == seen["model.norm"] == seen["lm_head"] == "torch.float32"
            assert seen["model.layers.0.input_layernorm"] == "torch.float32"
    # The previous policy (param_dtype=bf16 on every group: bf16 norms, embeddings, residual stream) fails both checks.
    old = _spawn_bf16("fsdp-bf16-params", tmp_path, rows)
    assert float((old["logp"] - ref["logp"]).abs().max()) > 100 * STATS_TOL
    assert _update_difference(old, ref, "weights_1") > 100 * UPDATE_TOL


def test_bf16_second_update_amplifies_one_ulp_weight_differences():
    """The mechanism behind TRAJECTORY_TOL: one float32 ulp on every weight before the second bf16 update moves the
    trajectory far beyond UPDATE_TOL (so no engine can promise trajectory equality at UPDATE_TOL on every ISA), and
    stays within TRAJECTORY_TOL."""
    ref = fsdp_dist_worker.reference_bf16()
    nudged = fsdp_dist_worker.reference_bf16(nudge_ulp=True)
    assert _update_difference(nudged, ref, "weights_1") == 0  # the same first update
    drift = _update_difference(nudged, ref, "weights_2")
    assert 10 * UPDATE_TOL < drift < TRAJECTORY_TOL, drift


def test_linear_groups_and_all_gather_bytes_of_a_qwen2_5_1_5b_layout():
    """The bf16 groups are exactly the modules autocast computes in bf16; bytes per full unshard for the shipped
    model's architecture (built on the meta device, nothing downloaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    layer = fsdp.decoder_layers(model)[0]
    assert [type(m).__name__ for m in fsdp.linear_groups(layer)] == ["Qwen2Attention", "Qwen2MLP"]
    b = fsdp.all_gather_bytes(model, "bfloat16")
    assert b["fp32"] == 4 * 1_543_714_304  # Qwen2.5-1.5B's parameter count (tied embedding once)
    assert round(b["ours"] / 1e9, 2) == 3.55 and round(b["fp32"] / 1e9, 2) == 6.17
    assert round(b["all_low"] / 1e9, 2) == 3.09
