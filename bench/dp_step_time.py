"""Train step time of the data-parallel engines on CPU for the tiny model: fsdp:d2 and torch:d2 (two gloo processes,
one torch thread each) against torch:d1 (this process, one thread), measured in the same process tree.

    python bench/dp_step_time.py [--steps 10] [--rows 128] [--response 10] [--prompt 16]

Every engine trains the same random batch (the default CPU run's shape: 32 prompts x 4 samples, 10 new tokens) with
the same seeds; correctness first: the weights after the timed steps are compared with torch:d1's. A step is one
Actor.update (forward + backward over the micro-batches, M2PO selection, gradient reduction, AdamW), timed on rank
0 between barriers; the median over --steps after 2 warm-up steps. Never asserted on.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from stalerl.training.actor import Actor, DataParallel  # noqa: E402
from stalerl.config import load_config  # noqa: E402
from stalerl.core.model import load_policy  # noqa: E402
from stalerl.rollout.batch import RolloutBatch  # noqa: E402

WARMUP = 2
OVERRIDES = ["actor.optimizer.eps=1e-3", "actor.optimizer.lr=1e-3", "actor.m2_threshold=0.04"]


def make_batch(rows: int, prompt: int, response: int):
    g = torch.Generator().manual_seed(0)
    resp_len = torch.randint(response // 2, response + 1, (rows,), generator=g)
    response_mask = torch.arange(response).unsqueeze(0) < resp_len.unsqueeze(1)
    batch = RolloutBatch(
        prompt_ids=torch.randint(4, 100, (rows, prompt), generator=g), prompt_mask=torch.ones(rows, prompt).bool(),
        response_ids=torch.randint(4, 100, (rows, response), generator=g), response_mask=response_mask,
        behavior_logp=torch.where(response_mask, -torch.rand(rows, response, generator=g) * 5, torch.zeros(())),
        versions=torch.zeros(rows, response, dtype=torch.long), rewards=torch.zeros(rows),
        group_ids=torch.arange(rows) // 4)
    adv = torch.where(response_mask, torch.randn(rows, 1, generator=g).expand(rows, response), torch.zeros(()))
    return batch, adv


def timed_updates(actor: Actor, batch, adv, steps: int, sizes=None, group=None) -> list[float]:
    times = []
    for i in range(WARMUP + steps):
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        actor.update(batch, adv, minibatch_sizes=sizes)
        if group is not None:
            dist.barrier(group)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def rank_main(rank: int, world: int, port: int, engine: str, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    cfg = load_config(OVERRIDES).actor
    model, _ = load_policy("tiny:qwen2", seed=0)
    batch, adv = make_batch(args.rows, args.prompt, args.response)
    share = torch.tensor_split(torch.arange(batch.num_rows), world)[rank]
    sub = batch.select(share.tolist())
    actor = Actor(model, cfg, temperature=1.0, total_updates=100,
                  dp=DataParallel(rank=rank, size=world, group=dist.group.WORLD))
    if engine == "fsdp":
        actor.shard("float32")
    times = timed_updates(actor, sub, adv[share, :sub.response_ids.shape[1]], args.steps,
                          sizes=[int(share.numel())], group=dist.group.WORLD)
    weights = actor.full_model_state()
    if rank == 0:
        torch.save({"times": times, "weights": {k: v.clone() for k, v in weights.items()}}, out)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = load_config(OVERRIDES).actor
    model, _ = load_policy("tiny:qwen2", seed=0)
    batch, adv = make_batch(args.rows, args.prompt, args.response)
    actor = Actor(model, cfg, temperature=1.0, total_updates=100)
    base = timed_updates(actor, batch, adv, args.steps)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    results = {"torch:d1": base}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("torch", "fsdp"):
            out = os.path.join(tmp, f"{engine}.pt")
            mp.spawn(rank_main, args=(2, free_port(), engine, args, out), nprocs=2, join=True)
            got = torch.load(out, weights_only=False)
            diff = max(float((got["weights"][k] - ref[k]).abs().max()) for k in ref)
            print(f"correctness {engine}:d2 vs torch:d1 after {WARMUP + args.steps} updates: max |dw| = {diff:.2e}")
            results[f"{engine}:d2"] = got["times"]
    d1 = statistics.median(base)
    print(f"tiny:qwen2 ({sum(p.numel() for p in model.parameters()):,} parameters), {args.rows} rows x "
          f"({args.prompt} prompt + {args.response} response) tokens, 1 torch thread per process, "
          f"median of {args.steps} steps")
    print(f"{'backend':10s} {'step ms':>9s} {'vs torch:d1':>12s}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:10s} {med * 1e3:9.1f} {med / d1:11.2f}x")


if __name__ == "__main__":
    main()
