"""A real model's training and generation speed beside this machine's limits, measured in one process.

    python bench/real_model_limits.py [--model smollm2-135m-instruct|DIR] [--threads 2] [--steps 3]
                                      [--config examples/math/smollm2_add_m2po_cpu.yaml] [key=value ...]

Printed, each with its ratio to the limit it is measured against:
- training: model FLOP/s of the actor's forward/backward (timing/split/forward_backward_s of real train steps of the
  config, the first step left out) against a torch fp32 GEMM (2048^3) on the same threads. Model FLOPs per step:
  6 x (non-embedding parameters) x (prompt + response tokens) + 6 x (head parameters) x (response tokens + 1 per
  row) (the trainer computes head logits only for the response: logits_to_keep), attention's T^2 terms left out;
- generation: tokens/s of the HF engine at batch 1 and batch 32 (sampled, the config's max_new_tokens; only valid
  response tokens count) against the decode bound of reading every weight once per step: batch x bandwidth /
  (parameter bytes), the bandwidth measured by copying a 512 MiB tensor (read + write bytes / time) on the same
  threads; and against the compute bound 2 x parameters x batch per token step at the GEMM rate. Goal (issue 36):
  batch 32 >= 10x batch 1.

Not asserted on time: figures and ratios only (a busy machine lowers them all; run it on an idle one).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def gemm_gflops(threads: int, n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def copy_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 5) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - start) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--config", default=str(REPO / "examples" / "math" / "smollm2_add_m2po_cpu.yaml"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="train steps (the first is left out of the figure)")
    ap.add_argument("--gen-tokens", type=int, default=None,
                    help="max new tokens of the generation figures (default: the config's gconfig.max_new_tokens; "
                         "short answers are dominated by the prompt's prefill, which batching cannot amortise)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import tempfile

    from stalerl.config import load_config
    from stalerl.training.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="stalerl-limits-"))
    cfg = load_config(["--config", args.config, f"actor.path={args.model}", f"torch_threads={args.threads}",
                       f"cluster.fileroot={work}", "rollout.fixed_staleness=0", "recover.mode=disabled",
                       "stats_logger.mismatch_freq_steps=null", "stats_logger.tensorboard=false",
                       f"total_train_steps={args.steps}", *args.overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.warm_start_done = True
    model = trainer.model
    params = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight.numel()
    body = params - head  # tied embeddings: the embedding lookup is no matmul; the head is (vocab x hidden)
    print(f"model {args.model}: {params / 1e6:.1f}M parameters ({body / 1e6:.1f}M non-embedding), "
          f"torch {torch.__version__}, {args.threads} threads, actor.dtype={cfg.actor.dtype}")

    peak = gemm_gflops(args.threads)
    bandwidth = copy_bandwidth_gbs(args.threads)
    bf16 = gemm_gflops(args.threads, dtype=torch.bfloat16)
    print(f"limits: fp32 GEMM 2048^3 {peak:.1f} GFLOP/s (bf16: {bf16:.1f}, {bf16 / peak:.1f}x); memory copy "
          f"{bandwidth:.1f} GB/s")

    # training: real steps of the config
    flops, seconds = [], []
    generated = []
    generate = trainer.generate_batch

    def capture():
        generated.append(generate())
        return generated[-1]

    trainer.generate_batch = capture
    for step in range(args.steps):
        generated.clear()
        m = trainer.train_step()
        batch = generated[-1]
        tokens = float(batch.attention_mask().sum())
        response = float(batch.response_mask.sum()) + batch.num_rows
        f = 6 * body * tokens + 6 * head * response
        t = m["timing/split/forward_backward_s"]
        print(f"  train step {step + 1}: {batch.num_rows} rows, {tokens:.0f} tokens, forward/backward {t:.2f} s, "
              f"optimizer {m['timing/split/optimizer_s']:.2f} s, generation {m['timing/split/generation_s']:.2f} s "
              f"-> {f / t / 1e9:.1f} GFLOP/s")
        if step > 0 or args.steps == 1:
            flops.append(f)
            seconds.append(t)
    train_rate = sum(flops) / sum(seconds) / 1e9
    print(f"training: {train_rate:.1f} GFLOP/s = {train_rate / peak:.2f}x the fp32 GEMM (goal >= 0.50)")

    # generation at batch 1 and 32
    from stalerl.data import load_examples

    ds = cfg.valid_dataset
    examples = load_examples(ds.path, "test", synthetic_task=ds.synthetic.task, max_operand=ds.synthetic.max_operand,
                             test_size=ds.synthetic.test_size, seed=ds.synthetic.seed,
                             question_style=ds.synthetic.question_style)
    g = cfg.gconfig
    rates = {}
    for batch_size, reps in ((1, 4), (32, 2)):
        tokens, elapsed = 0, 0.0
        for r in range(reps):
            chunk = examples[r * batch_size:(r + 1) * batch_size]
            torch.manual_seed(r)
            start = time.perf_counter()
            out = trainer.engine.generate([e.question for e in chunk], [e.final for e in chunk], n_samples=1,
                                          max_new_tokens=args.gen_tokens or g.max_new_tokens,
                                          temperature=g.temperature)
            elapsed += time.perf_counter() - start
            tokens += int(out.response_mask.sum())
        rates[batch_size] = tokens / elapsed
        weight_bound = batch_size * bandwidth * 1e9 / (params * 4)
        compute_bound = peak * 1e9 / (2 * params)
        bound = min(weight_bound, compute_bound)
        print(f"generation batch {batch_size}: {rates[batch_size]:.1f} tokens/s; bound {bound:.0f} tokens/s "
              f"(weights read once per step {weight_bound:.0f}, compute {compute_bound:.0f}) -> "
              f"{rates[batch_size] / bound:.2f}x the bound")
    print(f"generation batch 32 / batch 1: {rates[32] / rates[1]:.1f}x (goal >= 10x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
