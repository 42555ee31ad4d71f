"""Ranks of tests/unit/test_metric_rules.py: a loss with one SUM, one MAX and one MEAN metric, trained by the
runtime's Actor over 2 mini-batches on each of ``world`` gloo ranks; every rank writes the step's metrics and the
per-micro-batch values its loss returned (recorded by the loss itself), so the test can reduce them literally."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from fsdp_dist_worker import join_group, rank_share, setup
from recipe.common import agg_loss, check_inputs, clamp_log_ratio, global_batch_info, masked_log_ratio
from recipe.declaration import MAX, MEAN, SUM, LossDeclaration
from recipe.registry import is_policy_loss_registered, register_policy_loss
from stalerl.config import load_config
from stalerl.training.actor import Actor, DataParallel

NAME = "metric_rule_probe"
CALLS: list[dict] = []  # every call's (valid tokens, rows, metrics), in call order

DECLARATION = LossDeclaration(
    name=NAME, summary="-A r, unclipped, with a SUM, a MAX and a MEAN metric (a test of metric rules).",
    params=(), metrics={"probe/num_tokens": SUM, "probe/ratio_max": MAX, "probe/ratio_mean": MEAN})


def probe_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
               rollout_is_weights=None):
    valid = check_inputs(NAME, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    ratio = torch.exp(clamp_log_ratio(masked_log_ratio(old_log_prob, log_prob, valid)))
    adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
    loss = agg_loss(-adv * ratio, valid, loss_agg_mode, **global_batch_info(config))
    with torch.no_grad():
        r = torch.where(valid, ratio.detach(), torch.zeros_like(ratio))
        metrics = {"probe/num_tokens": float(valid.sum()), "probe/ratio_max": float(r.max()),
                   "probe/ratio_mean": float(r.sum() / valid.sum().clamp(min=1))}
    CALLS.append({"valid_tokens": float(valid.sum()), "rows": int(valid.shape[0]), "metrics": metrics})
    return loss, metrics


def register() -> None:
    if not is_policy_loss_registered(NAME):
        register_policy_loss(DECLARATION)(probe_loss)


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    register()
    if world > 1:
        join_group(rank, world, port, timeout_s=300)
    model, batch, adv = setup()
    cfg = load_config([f"actor.loss={NAME}", "actor.ppo_n_minibatches=2", "train_dataset.batch_size=6",
                       "actor.mb_spec.max_tokens_per_mb=48", "actor.optimizer.lr=1e-2"])
    sub, sub_adv, sizes = rank_share(batch, adv, rank, world, 2)
    dp = DataParallel(rank, world, dist.group.WORLD if world > 1 else None)
    actor = Actor(model, cfg.actor, temperature=1.0, total_updates=1, dp=dp)
    metrics = actor.update(sub, sub_adv, minibatch_sizes=sizes)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"metrics": metrics, "calls": CALLS}, f)
    if world > 1:
        dist.barrier()  # no rank closes its sockets while another still reads the last collective
        dist.destroy_process_group()
