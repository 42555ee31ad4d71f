"""One rank of the two-rank AReaL update (test harness for test_areal_two_ranks.py).

Run by ``torch.multiprocessing.spawn`` in a fresh process per rank: AReaL's FSDP engine on a gloo world of two CPU
ranks (``backend="fsdp:d2p1t1"``), each rank holding its half of the mini-batch's rows; what AReaL computed (the
mini-batch after the selection, the scaled micro-batch losses, the weights before and after the step, the stats
export reduced over the data-parallel group) is saved for the parent to compare with the references.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def rank_rows(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s contiguous share of the rows of every tensor (the mini-batch split over data-parallel ranks)."""
    n = next(iter(batch.values())).shape[0]
    share = n // world
    return {k: v[rank * share:(rank + 1) * share].clone() for k, v in batch.items()}


def run_rank(rank: int, world: int, port: int, model_dir: str, loss: str, n_mbs: int, batch_path: str,
             out_dir: str, extra: dict[str, Any]) -> None:
    # AReaL's engine calls init_process_group (env://) itself; with TORCHELASTIC_USE_AGENT_STORE every rank joins
    # the store on MASTER_PORT as a client, as under torchrun: the parent holds that store (tests/_ports.py)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), AREAL_SPMD_MODE="1", TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)  # two ranks on a shared CPU
    from areal.utils import stats_tracker

    from _varlen_attention import varlen_sdpa_installed
    from test_areal_actor import _actor_config, _engine, _full_params, _Recorder

    half = rank_rows(torch.load(batch_path), rank, world)
    with varlen_sdpa_installed():
        engine = _engine(_actor_config(Path(model_dir), loss, n_mbs, backend=f"fsdp:d{world}p1t1", **extra))
        assert engine.data_parallel_world_size == world
        before = _full_params(engine)
        recorder = _Recorder(engine)
        stats_tracker.export(reset=True)  # a clean tracker
        engine.ppo_update([half])  # one trajectory group: this rank's rows
        stats = stats_tracker.export(reduce_group=engine.data_parallel_group)  # as AReaL's trainer exports
        after = _full_params(engine)
        engine.destroy()
    torch.save({"before": before, "after": after, "stats": stats, "mini_batches": recorder.mini_batches,
                "scaled_losses": [x.cpu() for x in recorder.scaled_losses],
                "num_micro_batches": len(recorder.micro_batches)}, Path(out_dir) / f"rank{rank}.pt")
