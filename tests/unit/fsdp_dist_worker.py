"""Ranks of the two-process gloo tests in tests/unit/test_fsdp.py (kept out of the test module so spawned processes
import only what they need). Every rank builds the same tiny model and batch from seeds, takes its share of each
global mini-batch (as AsyncTrainer._update cuts them), trains, and rank 0 writes the full weights and metrics."""

from __future__ import annotations

import copy
import datetime
import os

import torch
import torch.distributed as dist

from stalerl.training.actor import Actor, DataParallel
from stalerl.training.advantage import grpo_advantages
from stalerl.config import NormConfig, load_config
from stalerl.core.model import PromptFormatter, load_policy
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.engine import HFRolloutEngine

QUESTIONS = ["12+7=?", "3+45=?", "99+1=?", "8+8=?", "40+2=?", "5+5=?"]
ANSWERS = ["19", "48", "100", "16", "42", "10"]
# AdamW (so a resume must restore its moments) with eps large enough that float noise in near-zero gradients is not
# amplified into a full lr-sized step (tiny eps makes the first step ~lr * sign(g), which flips on noise).
OVERRIDES = ["actor.optimizer.eps=1e-3", "actor.loss=m2po", "actor.m2_threshold=0.01", "actor.optimizer.lr=1e-2",
             "actor.ppo_n_minibatches=2", "train_dataset.batch_size=6", "actor.optimizer.gradient_clipping=1.0"]


def setup():
    """The tiny policy and a stale batch (behaviour log-probs from perturbed weights, random rewards)."""
    torch.manual_seed(0)
    model, tok = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    torch.manual_seed(5)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = HFRolloutEngine(behaviour, tok, PromptFormatter(tok).format, gsm8k_reward)
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8)
    batch.rewards = (torch.rand(batch.num_rows) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())
    return model, batch, adv


def rank_share(batch, adv, rank: int, world: int, n_mini: int):
    rows, sizes = [], []
    for mini in torch.tensor_split(torch.arange(batch.num_rows), n_mini):
        share = torch.tensor_split(mini, world)[rank]
        rows += share.tolist()
        sizes.append(int(share.numel()))
    sub = batch.select(rows)
    return sub, adv[rows, :sub.response_ids.shape[1]], sizes


def run_rank(rank: int, world: int, port: int, out_dir: str, engine: str, max_tokens_per_mb: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cfg = load_config([*OVERRIDES, f"actor.mb_spec.max_tokens_per_mb={max_tokens_per_mb}"]).actor
        model, batch, adv = setup()
        sub, sub_adv, sizes = rank_share(batch, adv, rank, world, cfg.ppo_n_minibatches)
        dp = DataParallel(rank=rank, size=world, group=dist.group.WORLD)

        def make_actor(m):
            a = Actor(m, cfg, temperature=1.0, total_updates=4, dp=dp)
            if engine == "fsdp":
                a.shard("float32", copy_model=False)
            return a

        actor = make_actor(model)
        reduced = []  # sizes of the tensors all-reduced during the first update
        plain_all_reduce = dist.all_reduce

        def counting_all_reduce(tensor, *a, **kw):
            reduced.append(tensor.numel())
            return plain_all_reduce(tensor, *a, **kw)

        dist.all_reduce = counting_all_reduce
        try:
            metrics = [actor.update(sub, sub_adv, minibatch_sizes=sizes)]
        finally:
            dist.all_reduce = plain_all_reduce
        state = copy.deepcopy(actor.state_dict())  # collective for fsdp: full state on rank 0; a copy, as saved
        saved = copy.deepcopy(state)  # loading aliases the tensors (the resumed optimizer steps them in place)
        weights_1 = copy.deepcopy(actor.full_model_state())  # replicas: live tensors, copy before update 2
        metrics.append(actor.update(sub, sub_adv, minibatch_sizes=sizes))
        weights_2 = actor.full_model_state()

        # Resume: fresh replicas, rank 0 loads the full checkpoint state, broadcast, shard, one more update.
        fresh, _, _ = setup()
        resumed = Actor(fresh, cfg, temperature=1.0, total_updates=4, dp=dp)
        if rank == 0:
            resumed.load_state_dict(state)
        follows = bool(resumed.has_pending_optimizer_state) if rank == 0 else None
        flag = [follows]
        dist.broadcast_object_list(flag, src=0)
        sched = [resumed.lr_scheduler.state_dict()]
        dist.broadcast_object_list(sched, src=0)
        with torch.no_grad():
            for t in resumed.model.state_dict().values():
                dist.broadcast(t, src=0)
        if engine == "fsdp":
            resumed.shard("float32", lr_scheduler_state=sched[0], optimizer_state_follows=flag[0])
        else:  # replicas: every rank loads the whole state (as AsyncTrainer's load_actor_state does)
            full = _broadcast_state(state if rank == 0 else None)
            if rank != 0:
                resumed.load_state_dict(full)
        resumed_metrics = resumed.update(sub, sub_adv, minibatch_sizes=sizes)
        weights_resumed = resumed.full_model_state()
        if rank == 0:
            torch.save({"metrics": metrics, "weights_1": weights_1, "weights_2": weights_2,
                        "resumed_metrics": resumed_metrics, "weights_resumed": weights_resumed,
                        "sharded": actor.sharded, "state_keys": sorted(state),
                        "reduced": reduced, "state": saved},
                       os.path.join(out_dir, f"{engine}.pt"))
        # Tear down together: a rank that destroys its gloo group while rank 0 is still saving can abort
        # ("terminate called without an active exception", seen once in CI).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _broadcast_state(state):
    box = [state]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reference(max_tokens_per_mb: int) -> dict:
    """torch:d1 in this process: the same two updates on the whole batch."""
    cfg = load_config([*OVERRIDES, f"actor.mb_spec.max_tokens_per_mb={max_tokens_per_mb}"]).actor
    model, batch, adv = setup()
    actor = Actor(model, cfg, temperature=1.0, total_updates=4)
    metrics = [actor.update(batch, adv)]
    weights_1 = {k: v.clone() for k, v in model.state_dict().items()}
    metrics.append(actor.update(batch, adv))
    return {"metrics": metrics, "weights_1": weights_1, "weights_2": dict(model.state_dict())}


def resume_plain(state: dict, max_tokens_per_mb: int) -> dict:
    """torch:d1 resumed from a (sharded run's) full state, then the second update."""
    cfg = load_config([*OVERRIDES, f"actor.mb_spec.max_tokens_per_mb={max_tokens_per_mb}"]).actor
    model, batch, adv = setup()
    actor = Actor(model, cfg, temperature=1.0, total_updates=4)
    actor.load_state_dict(state)
    actor.update(batch, adv)
    return dict(model.state_dict())
