"""Ranks of the two-process gloo tests in tests/unit/test_fsdp.py (kept out of the test module so spawned processes
import only what they need). Every rank builds the same tiny model and batch from seeds, takes its share of each
global mini-batch (as AdmissionSource.update cuts them), trains, and rank 0 writes the full weights and metrics."""

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


def join_group(rank: int, world: int, port: int, timeout_s: float) -> None:
    """The gloo group, as a client of the store test_fsdp holds on ``port`` (tests/_ports.py): no rank binds the
    port, so none can lose it to another process."""
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout),
                            rank=rank, world_size=world, timeout=timeout)


def run_rank(rank: int, world: int, port: int, out_dir: str, engine: str, max_tokens_per_mb: int) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 120)
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
        reduced = []  # sizes of the float32 tensors (gradients, loss scalars) all-reduced during the first update
        plain_all_reduce = dist.all_reduce

        def counting_all_reduce(tensor, *a, **kw):
            if tensor.dtype != torch.float64:  # M2PO's selection all-reduces float64 histograms: not gradients
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
        else:  # replicas: every rank loads the whole state (as AdmissionSource.on_training_start's load_actor_state does)
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


# ------------------------------------------------------------------------------------ bf16 (actor.dtype=bfloat16)
# SGD: the weight change is lr x gradient, so the relative difference of two updates is that of their gradients.
BF16_OVERRIDES = [*OVERRIDES, "actor.dtype=bfloat16", "actor.optimizer.type=sgd", "actor.ppo_n_minibatches=1"]


def setup_on_policy_bf16():
    """The tiny policy and an on-policy batch: generated by the same weights under bf16 autocast (as the rollout
    engine does for actor.dtype=bfloat16), so behaviour log-probs are the bf16 computation's."""
    torch.manual_seed(0)
    model, tok = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    torch.manual_seed(5)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, compute_dtype="bfloat16")
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8)
    batch.rewards = (torch.rand(batch.num_rows) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())
    return model, batch, adv


def bf16_steps(actor, batch, adv, sizes=None, between=None) -> dict:
    """On-policy log-probs (no grad), then two updates; the weights after each (full state: collective).
    ``between(model)``, if given, edits the weights after the first update is recorded (SGD keeps no other state)."""
    logp = actor.compute_logp(batch)
    metrics = [actor.update(batch, adv, minibatch_sizes=sizes)]
    weights_1 = copy.deepcopy(actor.full_model_state())
    if between is not None:
        with torch.no_grad():
            between(actor.model)
    metrics.append(actor.update(batch, adv, minibatch_sizes=sizes))
    return {"logp": logp, "metrics": metrics, "weights_1": weights_1,
            "weights_2": copy.deepcopy(actor.full_model_state())}


def run_rank_bf16(rank: int, world: int, port: int, out_dir: str, engine: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 120)
    try:
        cfg = load_config([*BF16_OVERRIDES, "actor.mb_spec.max_tokens_per_mb=60"]).actor
        model, batch, adv = setup_on_policy_bf16()
        rows = [r for mini in torch.tensor_split(torch.arange(batch.num_rows), cfg.ppo_n_minibatches)
                for r in torch.tensor_split(mini, world)[rank].tolist()]
        sub, sub_adv, sizes = rank_share(batch, adv, rank, world, cfg.ppo_n_minibatches)
        actor = Actor(model, cfg, temperature=1.0, total_updates=4,
                      dp=DataParallel(rank=rank, size=world, group=dist.group.WORLD))
        seen = {}
        if engine == "fsdp-bf16-params":  # the policy fsdp.py used before: every parameter all-gathered in bf16
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from stalerl.training import fsdp
            actor.model.to(torch.float32)
            old = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            original = fsdp.shard_model
            fsdp.shard_model = lambda m, w, d: _shard_everything(m, w, old)
            try:
                actor.shard("bfloat16")
            finally:
                fsdp.shard_model = original
        if engine == "fsdp":
            actor.shard("bfloat16")
            # the dtype each module's weight has while the sharded forward runs (FSDP swaps the unsharded one in)
            for name, module in actor.model.named_modules():
                w = getattr(module, "weight", None)
                if isinstance(w, torch.nn.Parameter) and next(module.children(), None) is None:
                    module.register_forward_pre_hook(
                        lambda m, a, name=name: seen.setdefault(name, str(m.weight.dtype)) and None)
        out = bf16_steps(actor, sub, sub_adv, sizes)
        out.update(rows=rows, seen=seen, batch=batch)
        torch.save(out, os.path.join(out_dir, f"bf16-{engine}-{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _shard_everything(model, world, policy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stalerl.training import fsdp
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def reference_bf16(dtype: str = "bfloat16", second_update_from: dict | None = None, nudge_ulp: bool = False) -> dict:
    """torch:d1 in this process on the same on-policy batch (``dtype`` float32: the same run in fp32 compute).
    ``second_update_from``: full weights loaded before the second update (another engine's weights_1), so the two
    engines' second updates start from the same weights; ``nudge_ulp``: every weight moved by one float32 ulp (up)
    before the second update."""
    cfg = load_config([*BF16_OVERRIDES, f"actor.dtype={dtype}", "actor.mb_spec.max_tokens_per_mb=60"]).actor
    model, batch, adv = setup_on_policy_bf16()
    actor = Actor(model, cfg, temperature=1.0, total_updates=4)
    start = copy.deepcopy(actor.full_model_state())

    def between(m):
        if second_update_from is not None:
            m.load_state_dict(second_update_from)
        if nudge_ulp:
            for p in m.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))

    out = bf16_steps(actor, batch, adv, between=between if second_update_from is not None or nudge_ulp else None)
    out.update(batch=batch, weights_0=start)
    return out
