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

``--packed`` (``actor.mb_spec.pack_sequences``): on a real model (default SmolLM2-135M-Instruct, fetched with
``stalerl-model fetch smollm2-135m-instruct``), float32, rows of mixed lengths (prompts 20-60 tokens, responses 5-64,
uniform, random tokens), the actor's forward + backward over the same micro-batches padded and packed, alternated
rep by rep in one process: seconds per real token of each, their ratio, and the padding fraction packing removes.
The machine's load average is printed beside it (a shared machine slows both sides; the ratio is the figure).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stalerl.core.hardware import cpu_isa  # noqa: E402
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


def _mixed_batch(vocab: int, rows: int, seed: int):
    import torch

    from stalerl.rollout.batch import RolloutBatch

    rng = random.Random(seed)
    p_len = [rng.randint(20, 60) for _ in range(rows)]
    r_len = [rng.randint(5, 64) for _ in range(rows)]
    pw, rw = max(p_len), max(r_len)
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.tensor([[j >= pw - p for j in range(pw)] for p in p_len])
    response_mask = torch.tensor([[j < r for j in range(rw)] for r in r_len])
    return RolloutBatch(prompt_ids=torch.randint(3, vocab, (rows, pw), generator=g) * prompt_mask,
                        prompt_mask=prompt_mask,
                        response_ids=torch.randint(3, vocab, (rows, rw), generator=g) * response_mask,
                        response_mask=response_mask, behavior_logp=-torch.rand(rows, rw, generator=g) * response_mask,
                        versions=torch.zeros(rows, rw, dtype=torch.long), rewards=torch.rand(rows),
                        group_ids=torch.arange(rows) // 4)


def time_packed(model_name: str, rows: int, max_tokens: int, repeat: int, threads: int) -> None:
    import os

    import torch

    from stalerl.config import load_config
    from stalerl.core.model import load_policy
    from stalerl.training.actor import Actor

    torch.set_num_threads(threads)
    model, _ = load_policy(model_name, dtype="float32", device="cpu")
    batch = _mixed_batch(model.config.vocab_size, rows, seed=0)
    actors = {}
    for mode in ("padded", "packed"):
        cfg = load_config([f"actor.mb_spec.max_tokens_per_mb={max_tokens}",
                           f"actor.mb_spec.pack_sequences={str(mode == 'packed').lower()}"])
        actors[mode] = Actor(model, cfg.actor, temperature=1.0, total_updates=1)
    # The same micro-batches on both sides (the padded sizing), so only the packing differs.
    groups = actors["padded"].micro_batches(batch)
    p_len, r_len = batch.prompt_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist()
    real = sum(p_len) + sum(r_len)
    computed = padded_tokens(p_len, r_len, groups)
    packed_sizing = len(actors["packed"].micro_batches(batch))
    flags = cpu_isa()
    print(f"\n{model_name} float32, {rows} rows (prompts 20-60, responses 5-64), max_tokens_per_mb={max_tokens}: "
          f"{len(groups)} micro-batches (packed sizing by real tokens: {packed_sizing}), {threads} threads, "
          f"CPU flags {' '.join(flags) or 'n/a'}")
    print(f"  padded computes {computed:,} tokens for {real:,} real: packing removes {1 - real / computed:.1%} of the "
          "forward's tokens")

    def fwd_bwd(actor: Actor) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for rows_ in groups:
            mb = batch.select(rows_)
            lp = actor._forward_logp(mb)
            (lp * mb.response_mask).sum().backward()
        return time.perf_counter() - start

    model.train()
    fwd_bwd(actors["packed"])  # warm-up, both paths
    fwd_bwd(actors["padded"])
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for rep in range(repeat):
        for mode in (("padded", "packed") if rep % 2 == 0 else ("packed", "padded")):
            times[mode].append(fwd_bwd(actors[mode]))
        print(f"  rep {rep}: padded {times['padded'][-1]:.2f} s, packed {times['packed'][-1]:.2f} s, "
              f"load {os.getloadavg()[0]:.1f}")
    for mode in ("padded", "packed"):
        t = sorted(times[mode])[len(times[mode]) // 2]
        print(f"  {mode:>6}: median {t:.2f} s per forward+backward, {t / real * 1e3:.3f} ms per real token")
    ratios = sorted(b / a for a, b in zip(times["padded"], times["packed"]))
    print(f"  packed / padded time, per rep (alternating): {' '.join(f'{r:.2f}' for r in ratios)}; median "
          f"{ratios[len(ratios) // 2]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16384, 8192, 4096])
    ap.add_argument("--time", action="store_true", help="also time Actor.update on the tiny model (CPU)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--packed", action="store_true", help="time padded vs packed forward+backward on a real model")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="--packed's model (name or directory)")
    ap.add_argument("--rows", type=int, default=16, help="--packed's rows")
    ap.add_argument("--packed-max-tokens", type=int, default=1024, help="--packed's max_tokens_per_mb")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.packed:
        time_packed(args.model, args.rows, args.packed_max_tokens, args.repeat, args.threads)
        return
    padding_table(args.seeds, args.max_tokens)
    if args.time:
        time_update(args.repeat)


if __name__ == "__main__":
    main()
