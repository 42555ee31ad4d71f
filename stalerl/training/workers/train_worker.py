"""A data-parallel train rank (rank >= 1; rank 0 lives in the controller).

``torch:dY``: every rank holds a full replica and its optimizer. Each step the controller sends every rank its shard
of the batch; the actor all-reduces the token counts, runs the registered loss's mini-batch selection across the group
(M2PO's mask is exact over all ranks), and averages gradients (flattened buckets), so replicas stay identical without
ever exchanging weights.

``fsdp:dY``: the ranks start as identical replicas (rank 0's weights broadcast), then ``shard`` them with FSDP2 (see
:mod:`stalerl.training.fsdp`); each holds 1/Y of the parameters, gradients and optimizer state. After each update every rank
joins the gather of the full weights that rank 0 publishes, and checkpoints gather the full state on rank 0.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from stalerl.training.actor import Actor, DataParallel, correction_params
from stalerl.core.model import load_policy_from_config
from stalerl.training.workers.rollout_worker import from_wire


def master_store(host: str, world_size: int, timeout_s: float) -> tuple[Any, str]:
    """Rank 0's rendezvous store, listening before any rank is told where: bound to a port the OS picks (port 0) and
    held, so no other process can take it between choosing and binding (a free-port probe closed and re-bound later
    raced with other runs: EADDRINUSE under load). Returns (store, the init_method the other ranks connect to)."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"tcp://{host}:{store.port}"


def init_group(rank: int, world_size: int, init_method: Optional[str], timeout_s: float,
               store: Optional[Any] = None, share_gpu: bool = False) -> Any:
    # gloo for the CPU tensors (token counts, the M2PO selection's scalars), nccl for CUDA gradients; with
    # cluster.share_gpu every rank is on one device, which NCCL refuses (duplicate GPU): gloo for all of it.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and not share_gpu else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:  # rank 0 with its held store (master_store)
        # the prefix torch itself puts on a store made from an init_method, which the other ranks use
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return dist.group.WORLD


def broadcast_parameters(model: torch.nn.Module, group: Any) -> None:
    """Rank 0's weights to every rank (after rank 0's warm start or a checkpoint restore)."""
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0, group=group)


class TrainWorker:
    def __init__(self, cfg: Any, rank: int, world_size: int, init_method: str, total_updates: int,
                 timeout_s: float = 300.0):
        torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.rank = rank
        self.model, _ = load_policy_from_config(cfg)
        group = init_group(rank, world_size, init_method, timeout_s, share_gpu=cfg.cluster.share_gpu)
        self.actor = Actor(self.model, cfg.actor, temperature=cfg.gconfig.temperature, total_updates=total_updates,
                           dp=DataParallel(rank=rank, size=world_size, group=group),
                           loss_scale_factor=cfg.gconfig.max_new_tokens, correction=correction_params(cfg))
        print(f"train rank {rank}/{world_size} ready (pid {os.getpid()})", flush=True)

    def sync_parameters(self) -> None:
        broadcast_parameters(self.model, self.actor.dp.group)

    def load_actor_state(self, state: dict[str, Any]) -> None:
        self.actor.load_state_dict(state)

    def update(self, shard: dict[str, Any], advantages, minibatch_sizes: list[int]) -> dict[str, float]:
        metrics = self.actor.update(from_wire(shard), torch.as_tensor(advantages), minibatch_sizes=minibatch_sizes)
        if self.actor.sharded:
            self.actor.full_model_state()  # joins the gather of the weights rank 0 publishes (nothing lands here)
        return metrics

    def shard(self, optimizer_state_follows: bool, lr_scheduler_state: dict[str, Any]) -> None:
        """fsdp:dY: shard this rank's replica (collective, with every rank; see Actor.shard)."""
        self.actor.shard(self.cfg.actor.dtype, lr_scheduler_state=lr_scheduler_state,
                         optimizer_state_follows=optimizer_state_follows)

    def actor_state(self) -> None:
        """fsdp:dY: join the gather of the full actor state that rank 0 checkpoints."""
        self.actor.state_dict()
