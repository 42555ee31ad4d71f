"""Two data-parallel ranks inside AReaL (areal 1.0.4, CPU, gloo): each rank holds half of the mini-batch's rows.

AReaL's own code does the work on both ranks (``PPOActor._ppo_update``, the FSDP engine's micro-batching, its
``local_weight / total_weight * dp_size`` loss scaling with the weight all-reduced over the data-parallel group, FSDP's
gradient averaging, the stats tracker's export reduced over that group). The references are those of
test_areal_actor.py on the whole mini-batch (both ranks' rows) in one process: the literal Algorithm 1, the
registry's loss and gradient, and AReaL's one-rank update of the same rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from _areal_fixtures import model_dir  # noqa: F401 - pytest fixture
from _ports import held_store
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "unit"))  # the literal references
sys.path.insert(0, str(HERE))

from m2po_reference import reference_m2po  # noqa: E402

from _areal_two_ranks import rank_rows, run_rank  # noqa: E402
from _varlen_attention import varlen_sdpa_installed  # noqa: E402
from recipe.areal.packed import KEEP_MASK_KEY, select_mini_batch  # noqa: E402
from test_areal_actor import (FIPO_C, N_SEQ, TAU, _actor_config, _batch, _hf_logprobs, _reference_step,  # noqa: E402
                              _update)

pytestmark = pytest.mark.areal

WORLD = 2
_PAD = {"attention_mask": False, KEEP_MASK_KEY: False}


def _two_rank_update(model_dir: Path, tmp_path: Path, loss: str, batch: dict, extra: dict) -> list[dict]:
    import torch.multiprocessing as mp

    batch_path = tmp_path / "batch.pt"
    torch.save(batch, batch_path)
    # the ranks' store, held here until they are done; they join it as clients (run_rank), so no rank binds a port
    # that another process could have taken since it was chosen (tests/_ports.py)
    store = held_store()
    mp.spawn(run_rank, args=(WORLD, store.port, str(model_dir), loss, 2, str(batch_path), str(tmp_path), extra),
             nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _whole(halves: list[dict]) -> dict[str, torch.Tensor]:
    """Both ranks' mini-batches as one padded mini-batch (rank 0's rows first)."""
    width = max(h["loss_mask"].shape[1] for h in halves)
    out = {}
    for key, value in halves[0].items():
        if not (torch.is_tensor(value) and value.dim() == 2):
            continue
        parts = [torch.nn.functional.pad(h[key], (0, width - h[key].shape[1]), value=_PAD.get(key, 0)) for h in halves]
        out[key] = torch.cat(parts)
    return out


def _literal_keep(current: torch.Tensor, mini_batch: dict) -> torch.Tensor:
    mask = mini_batch["loss_mask"].bool()
    d = (current - mini_batch["logprobs"]).float()
    return torch.tensor(reference_m2po(d.tolist(), mini_batch["advantages"].tolist(), mask.tolist(), TAU)["keep"]) & mask


@pytest.mark.parametrize("loss", ["m2po", "fipo"])
def test_two_areal_ranks_with_half_the_mini_batch_each_make_the_whole_mini_batchs_update(
        model_dir: Path, tmp_path: Path, loss: str) -> None:
    """M2PO: the keep mask on each rank is its slice of Algorithm 1 over both ranks' tokens (not of each half alone);
    FIPO: the kept-token count pooled over the ranks. On both: the update is minus the registry loss's gradient of the
    whole mini-batch and equals AReaL's one-rank update of it; the exported metrics are the whole mini-batch's and the
    same on both ranks."""
    extra = {"fipo_clip_ratio_c": FIPO_C} if loss == "fipo" else {}
    batch = _batch(model_dir, seed=21)
    ranks = _two_rank_update(model_dir, tmp_path, loss, batch, extra)
    for r in ranks:
        assert len(r["mini_batches"]) == 1 and r["num_micro_batches"] == 2
        assert r["mini_batches"][0]["loss_mask"].shape[0] == N_SEQ // WORLD
    for name in ranks[0]["before"]:  # one model: same weights before and after on both ranks
        assert torch.equal(ranks[0]["before"][name], ranks[1]["before"][name]), name
        assert torch.equal(ranks[0]["after"][name], ranks[1]["after"][name]), name
    assert ranks[0]["stats"] == ranks[1]["stats"], "the exported metrics must be the same on both ranks"

    whole = _whole([r["mini_batches"][0] for r in ranks])
    mask = whole["loss_mask"].bool()
    expected_loss, grads, literal_keep, metrics = _reference_step(model_dir, loss, whole, **extra)
    # AReaL's scaling: sum over ranks of the scaled micro-batch losses = dp_size x the whole mini-batch's loss
    total = sum(torch.stack(r["scaled_losses"]).sum() for r in ranks)
    torch.testing.assert_close(total / WORLD, expected_loss, rtol=1e-5, atol=1e-7)
    before, after = ranks[0]["before"], ranks[0]["after"]
    for name, grad in grads.items():
        key = name if name in before else name.replace("model.", "", 1)
        torch.testing.assert_close(before[key] - after[key], grad, rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    with varlen_sdpa_installed():
        _, one_before, one_after = _update(model_dir, loss, n_mbs=2, batch=batch, **extra)
    for name in one_before:
        torch.testing.assert_close(after[name] - before[name], one_after[name] - one_before[name], rtol=1e-4,
                                   atol=1e-7, msg=lambda m: f"{name}: {m}")

    stats = ranks[0]["stats"]
    # each rank's half alone, with the current log-probs (the weights before the step), for what a per-rank decision
    # would have been
    _, current = _hf_logprobs(model_dir, whole["input_ids"], whole["attention_mask"])
    halves = [rank_rows({**whole, "current": current}, r, WORLD) for r in range(WORLD)]
    if loss == "m2po":
        assert torch.equal(whole[KEEP_MASK_KEY][mask], literal_keep[mask])
        assert (~literal_keep[mask]).any(), "the batch must be stale enough for Algorithm 1 to mask something"
        # the selection is not each rank's own: Algorithm 1 on a half alone keeps other tokens
        local = torch.cat([_literal_keep(h["current"], h) for h in halves])
        assert not torch.equal(local[mask], literal_keep[mask]), "the ranks' own selections must differ from one"
        n_masked = int((~literal_keep[mask]).sum())
        assert stats["m2po/num_masked_tokens"] == n_masked and stats["m2po/num_valid_tokens"] == int(mask.sum())
        for key in ("m2po/masked_fraction", "m2po/m2_before", "m2po/m2_after", "m2po/trust_region_fraction",
                    "m2po/threshold"):
            assert stats[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-7), key
    else:
        assert metrics["fipo/sequence_drop_ratio"] > 0, "the batch must make FIPO drop a row"
        for key, value in metrics.items():  # pooled over both ranks = the whole mini-batch's
            assert stats[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert stats["fipo/num_sequences"] == N_SEQ
        # the pooling matters: each half alone would scale its losses by another valid / kept ratio
        config = _actor_config(model_dir, loss, 1, **extra)
        pooled = select_mini_batch(loss, whole, current, config)
        assert (pooled.num_valid_tokens, pooled.num_kept_tokens) == (int(mask.sum()), stats["fipo/num_kept_tokens"])
        local = [select_mini_batch(loss, h, h["current"], config).step_scale for h in halves]
        assert local[0] != pytest.approx(local[1]), "the halves must drop different shares of their tokens"
