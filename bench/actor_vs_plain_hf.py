"""Where a real model's training step goes: stalerl's actor update against a plain HF forward/backward of the same
tokens, in one process, alternating, so a ratio is read under one machine state.

    python bench/actor_vs_plain_hf.py [--model smollm2-135m-instruct|DIR] [--rows 16] [--prompt 44] [--response 32]
                                      [--threads 1] [--repeats 5]

Same batch (random token ids of the given shape, every token valid; the PPO-clip loss on random advantages) for:
  plain      model(input_ids, logits_to_keep=R+1) -> log_softmax -> gather -> PPO-clip loss -> backward (what TRL's
             GRPOTrainer does for one micro-batch), no optimizer step
  plain+opt  the same plus clip_grad_norm_ and one AdamW step
  actor      stalerl's Actor.update (actor.loss=vanilla, one micro-batch), split into forward/backward and optimizer
  actor fwd  stalerl's no-grad log-prob pass over the batch (compute_logp)
Printed: median seconds of each, the ratios actor/plain+opt and actor forward-backward/plain, and the FLOP/s of the
plain forward/backward (6 x parameters x tokens, the embedding lookup counted as a matmul: an upper bound). Figures
only, nothing asserted.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _batch(tok_vocab: int, rows: int, prompt: int, response: int, seed: int = 0):
    from stalerl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, tok_vocab, (rows, prompt), generator=g)
    response_ids = torch.randint(10, tok_vocab, (rows, response), generator=g)
    mask_p = torch.ones(rows, prompt, dtype=torch.bool)
    mask_r = torch.ones(rows, response, dtype=torch.bool)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=mask_p, response_ids=response_ids, response_mask=mask_r,
                        behavior_logp=torch.full((rows, response), -2.0), versions=torch.zeros(rows, response,
                                                                                               dtype=torch.long),
                        rewards=torch.zeros(rows), group_ids=torch.arange(rows) // 4)


def plain_step(model, batch, adv, optimizer=None) -> float:
    start = time.perf_counter()
    ids = batch.input_ids()
    r = batch.response_ids.shape[1]
    out = model(input_ids=ids, attention_mask=batch.attention_mask().long(), use_cache=False, logits_to_keep=r + 1)
    logp = torch.log_softmax(out.logits[:, :r].float(), dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - batch.behavior_logp)
    loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    loss.backward()
    if optimizer is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True) if optimizer is not None else model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=44)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from stalerl.config import load_config
    from stalerl.core.model import load_policy_from_config
    from stalerl.training.actor import Actor

    cfg = load_config(["--config", str(REPO / "examples" / "math" / "smollm2_add_m2po_cpu.yaml"),
                       f"actor.path={args.model}", "actor.loss=vanilla", f"torch_threads={args.threads}"])
    model, tok = load_policy_from_config(cfg)
    batch = _batch(len(tok), args.rows, args.prompt, args.response)
    adv = torch.randn(args.rows, 1).expand(args.rows, args.response).contiguous()
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.rows * (args.prompt + args.response)
    plain_model = copy.deepcopy(model)
    plain_model.train()
    opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-7, betas=(0.9, 0.99), weight_decay=0.0)
    actor = Actor(model, cfg.actor, temperature=0.7, total_updates=10 * args.repeats)
    print(f"model {args.model}: {n_params / 1e6:.1f}M parameters, batch {args.rows} x ({args.prompt} + "
          f"{args.response}) = {tokens} tokens, {args.threads} thread(s), torch {torch.__version__}, chunked "
          f"log-probs {bool(actor.chunked_logprobs)}")
    times: dict[str, list[float]] = {"plain": [], "plain+opt": [], "actor": [], "actor fwd/bwd": [],
                                     "actor optimizer": [], "actor fwd (no grad)": []}
    plain_step(plain_model, batch, adv)  # warm-up
    actor.update(batch, adv)
    for _ in range(args.repeats):
        times["plain"].append(plain_step(plain_model, batch, adv))
        times["plain+opt"].append(plain_step(plain_model, batch, adv, opt))
        opt0 = actor.optimizer_seconds
        start = time.perf_counter()
        actor.update(batch, adv)
        total = time.perf_counter() - start
        times["actor"].append(total)
        times["actor optimizer"].append(actor.optimizer_seconds - opt0)
        times["actor fwd/bwd"].append(total - times["actor optimizer"][-1])
        start = time.perf_counter()
        actor.compute_logp(batch)
        times["actor fwd (no grad)"].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:<20} {v:8.3f} s (median of {args.repeats})")
    print(f"  actor / plain+opt           {med['actor'] / med['plain+opt']:.2f}x")
    print(f"  actor fwd/bwd / plain       {med['actor fwd/bwd'] / med['plain']:.2f}x")
    print(f"  plain forward/backward      {6 * n_params * tokens / med['plain'] / 1e9:.1f} GFLOP/s (6 N T bound)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
