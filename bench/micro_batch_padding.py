"""Padded tokens of the actor's micro-batches with and without length bucketing (``actor.mb_spec.length_bucketing``).

    python bench/micro_batch_padding.py [--seeds 20] [--max-tokens 16384 8192 4096] [--time]

The batch is GSM8K-shaped, as the shipped GPU configs train it: 64 prompts x 4 samples. Lengths are drawn, not read
from a run (no GSM8K run is available here): prompt = ~45 chat-template and instruction tokens + the question
(lognormal, median 60 tokens, 20-220, as GSM8K questions under the Qwen2.5 tokenizer); responses lognormal around a
per-prompt median (difficulty: median 250 tokens, spread 0.35) with per-sample spread 0.25, cut at
max_new_tokens=512. For each ``max_tokens_per_mb`` it prints, summed over ``--seeds`` batches: micro-batches per
step, the tokens the forward/backward computes (rows x (longest prompt + longest response) per micro-batch), the
real tokens, the padding share and the ratio bucketed / consecutive. ``--time`` also times ``Actor.update`` on the
embedded tiny model with the same lengths divided by 8 (CPU; a ratio, printed, never asserted on).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stalerl.training.actor import pack_micro_batches, padded_tokens  # noqa: E402

N_PROMPTS, N_SAMPLES, MAX_NEW = 64, 4, 512


def gsm8k_like_lengths(seed: int, scale: float = 1.0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prompt_len, resp_len = [], []
    for _ in range(N_PROMPTS):
        p = 45 + min(220, max(20, int(rng.lognormvariate(math.log(60), 0.35))))
        median = rng.lognormvariate(math.log(250), 0.35)
        for _ in range(N_SAMPLES):
            r = min(MAX_NEW, max(20, int(rng.lognormvariate(math.log(median), 0.25))))
            prompt_len.append(max(1, int(p * scale)))
            resp_len.append(max(1, int(r * scale)))
    return prompt_len, resp_len


def padding_table(seeds: int, budgets: list[int]) -> None:
    print(f"GSM8K-like batch: {N_PROMPTS} prompts x {N_SAMPLES} samples, {seeds} batches per row")
    print(f"{'max_tokens_per_mb':>18} {'mode':>12} {'mb/step':>8} {'computed':>12} {'real':>12} {'padding':>8} "
          f"{'ratio':>6}")
    for budget in budgets:
        base = None
        for mode, sort in (("consecutive", False), ("bucketed", True)):
            mbs = computed = real = 0
            for seed in range(seeds):
                p, r = gsm8k_like_lengths(seed)
                groups = pack_micro_batches(p, r, budget, sort_by_length=sort)
                mbs += len(groups)
                computed += padded_tokens(p, r, groups)
                real += sum(p) + sum(r)
            base = base or computed
            print(f"{budget:>18} {mode:>12} {mbs / seeds:>8.1f} {computed:>12,} {real:>12,} "
                  f"{1 - real / computed:>8.1%} {computed / base:>6.3f}")


def time_update(repeat: int) -> None:
    import copy

    import torch

    from stalerl.config import load_config
    from stalerl.core.model import load_policy
    from stalerl.rollout.batch import RolloutBatch
    from stalerl.training.actor import Actor

    torch.manual_seed(0)
    model, _ = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    p_len, r_len = gsm8k_like_lengths(0, scale=1 / 8)
    n, pw, rw = len(p_len), max(p_len), max(r_len)
    prompt_mask = torch.tensor([[j >= pw - p for j in range(pw)] for p in p_len])
    response_mask = torch.tensor([[j < r for j in range(rw)] for r in r_len])
    vocab = model.config.vocab_size
    batch = RolloutBatch(prompt_ids=torch.randint(3, vocab, (n, pw)) * prompt_mask,
                         prompt_mask=prompt_mask, response_ids=torch.randint(3, vocab, (n, rw)) * response_mask,
                         response_mask=response_mask, behavior_logp=-torch.rand(n, rw) * response_mask,
                         versions=torch.zeros(n, rw, dtype=torch.long), rewards=torch.rand(n),
                         group_ids=torch.arange(n) // N_SAMPLES, texts=[""] * n, answers=[""] * n)
    adv = torch.randn(n, 1).expand(n, rw).contiguous() * response_mask
    budget = 2048
    print(f"\nActor.update on tiny:qwen2, lengths / 8 ({n} rows, widths {pw}+{rw}), max_tokens_per_mb={budget}, "
          f"best of {repeat}:")
    best = {}
    for mode in ("false", "true"):
        cfg = load_config([f"actor.mb_spec.max_tokens_per_mb={budget}", f"actor.mb_spec.length_bucketing={mode}"])
        times = []
        for _ in range(repeat):
            actor = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=1)
            start = time.perf_counter()
            metrics = actor.update(batch, adv)
            times.append(time.perf_counter() - start)
        best[mode] = min(times)
        print(f"  length_bucketing={mode:<5} {best[mode]:.3f} s, "
              f"{metrics['actor/num_micro_batches']:.0f} micro-batches")
    print(f"  ratio bucketed / consecutive: {best['true'] / best['false']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16384, 8192, 4096])
    ap.add_argument("--time", action="store_true", help="also time Actor.update on the tiny model (CPU)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    padding_table(args.seeds, args.max_tokens)
    if args.time:
        time_update(args.repeat)


if __name__ == "__main__":
    main()
