"""A real model's training and generation speed beside this machine's limits, measured in one process.

    python bench/real_model_limits.py [--model smollm2-135m-instruct|DIR] [--threads 2] [--steps 3]
                                      [--config examples/math/smollm2_add_m2po_cpu.yaml] [key=value ...]

Printed, each with its ratio to the limit it is measured against:
- training: model FLOP/s of the actor's forward/backward (timing/split/forward_backward_s of real train steps of the
  config, the first step left out) against a torch fp32 GEMM (2048^3) on the same threads. Model FLOPs per step:
  6 x (non-embedding parameters) x (prompt + response tokens) + 6 x (head parameters) x (response tokens + 1 per
  row) (the trainer computes head logits only for the response: logits_to_keep), attention's T^2 terms left out;
- generation: tokens/s of the HF engine at batch 1 and batch 32 (sampled, the config's max_new_tokens; only valid
  response tokens count), for both of its decode paths, alternated rep by rep: ``generate`` (transformers' generate,
  the old path), ``static`` (stalerl.rollout.static_decode, the default) and ``static+compact`` (finished rows leave
  the batch: the engine's compact_finished_rows opt-in), against the decode bound of reading every
  weight once per step: batch x bandwidth / (parameter bytes), the bandwidth measured by copying a 512 MiB tensor
  (read + write bytes / time) on the same threads; and against the compute bound 2 x parameters x batch per token step
  at the GEMM rate. Each is given end to end and for the decode alone (the prompts' prefill, timed separately as one
  forward of the same prompts, taken out: short answers are dominated by the prefill, which the bound leaves out).
  Goals (issue 43): batch 32 >= 10x batch 1, and >= 0.50x the compute bound at batch 32. With gconfig.n_samples > 1
  batch 32 is also measured as the trainer generates it, 32 / n_samples prompts x n_samples samples (the static
  path prefills each prompt once).

The machine's load average is printed beside the figures (``os.getloadavg``): on a shared machine every figure drops.
``--skip-training`` measures the generation part only.

Not asserted on time: figures and ratios only (a busy machine lowers them all; run it on an idle one).
"""

from __future__ import annotations

import argparse
import os
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
    ap.add_argument("--skip-training", action="store_true", help="the generation figures only")
    ap.add_argument("--batches", default="1,32", help="generation batch sizes, comma-separated (default 1,32)")
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
    # Without bf16 units (AVX2 only) torch's bf16 matmul is emulated: 2048^3 takes about a minute per product at
    # 0.3 GFLOP/s (measured, 2-core AVX2 EPYC), so there it is measured at 512^3, said in the line.
    from stalerl.core.hardware import BF16_CPU_FLAGS, cpu_flags

    bf16_n = 2048 if any(f in cpu_flags() for f in BF16_CPU_FLAGS) else 512
    bf16 = gemm_gflops(args.threads, n=bf16_n, reps=5 if bf16_n == 2048 else 2, dtype=torch.bfloat16)
    print(f"limits: fp32 GEMM 2048^3 {peak:.1f} GFLOP/s (bf16 {bf16_n}^3: {bf16:.1f}, {bf16 / peak:.2f}x); memory "
          f"copy {bandwidth:.1f} GB/s")

    if not args.skip_training:
        measure_training(trainer, args.steps, body, head, peak)
    measure_generation(trainer, cfg, args, params, peak, bandwidth)
    return 0


def load_average() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def measure_training(trainer, steps: int, body: int, head: int, peak: float) -> None:
    """Real train steps of the config: model FLOP/s of the forward/backward against the fp32 GEMM."""
    flops, seconds = [], []
    generated = []
    source = trainer.source  # the rollout source generates (stalerl.training.sources)
    generate = source.generate_batch

    def capture():
        generated.append(generate())
        return generated[-1]

    source.generate_batch = capture
    for step in range(steps):
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
        if step > 0 or steps == 1:
            flops.append(f)
            seconds.append(t)
    train_rate = sum(flops) / sum(seconds) / 1e9
    print(f"training: {train_rate:.1f} GFLOP/s = {train_rate / peak:.2f}x the fp32 GEMM (goal >= 0.50); "
          f"{load_average()}")


def prefill_seconds(engine, questions) -> float:
    """One forward of the prompts as the engine feeds them (left-padded, last position's logits only)."""
    from stalerl.core.model import autocast_context

    ids, mask = engine.tokenize_prompts(questions)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)
    engine.model.eval()
    with torch.no_grad(), autocast_context(engine.device, engine.compute_dtype):
        start = time.perf_counter()
        engine.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, logits_to_keep=1)
        return time.perf_counter() - start


def measure_generation(trainer, cfg, args, params: int, peak: float, bandwidth: float) -> None:
    """The HF engine's decode paths at each batch size, alternated rep by rep so that a change of load hits them
    alike."""
    from stalerl.core.reward import gsm8k_reward
    from stalerl.data import load_examples
    from stalerl.rollout.engine import DECODE_PATHS, HFRolloutEngine

    ds = cfg.valid_dataset
    examples = load_examples(ds.path, "test", synthetic_task=ds.synthetic.task, max_operand=ds.synthetic.max_operand,
                             test_size=ds.synthetic.test_size, seed=ds.synthetic.seed,
                             question_style=ds.synthetic.question_style, holdout=ds.synthetic.holdout)

    def engine(decode: str, compact: bool = False) -> HFRolloutEngine:
        return HFRolloutEngine(trainer.model, trainer.tokenizer, trainer.formatter.format, gsm8k_reward,
                               device=trainer.device, compute_dtype=cfg.actor.dtype, decode=decode,
                               compact_finished_rows=compact)

    engines = {d: engine(d) for d in DECODE_PATHS}
    engines["static+compact"] = engine("static", compact=True)  # the opt-in: finished rows leave the batch
    g = cfg.gconfig
    max_new = args.gen_tokens or g.max_new_tokens
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[tuple[str, int], float] = {}
    print(f"generation: sampled at T {g.temperature}, up to {max_new} new tokens; {load_average()}")
    shapes = [(b, 1) for b in batches]
    # the trainer's own shape: n samples of each prompt (the static path prefills each prompt once)
    shapes += [(b, g.n_samples) for b in batches if g.n_samples > 1 and b > g.n_samples and b % g.n_samples == 0]
    for batch_size, n_samples in shapes:
        reps = 4 if batch_size == 1 else 2
        n_prompts = batch_size // n_samples
        if len(examples) < reps * n_prompts:
            raise SystemExit(f"valid_dataset has {len(examples)} examples: batch {batch_size} x {reps} reps needs "
                             f"{reps * n_prompts} (raise valid_dataset.synthetic.test_size)")
        tokens = {d: 0 for d in engines}
        elapsed = {d: 0.0 for d in engines}
        steps = {d: 0 for d in engines}
        prefill = 0.0
        for r in range(reps):
            chunk = examples[r * n_prompts:(r + 1) * n_prompts]
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for decode in order:
                torch.manual_seed(r)
                start = time.perf_counter()
                out = engines[decode].generate([e.question for e in chunk], [e.final for e in chunk],
                                               n_samples=n_samples, max_new_tokens=max_new,
                                               temperature=g.temperature)
                elapsed[decode] += time.perf_counter() - start
                tokens[decode] += int(out.response_mask.sum())
                steps[decode] += engines[decode].last_decode_steps
            prefill += prefill_seconds(engines["static"], [e.question for e in chunk for _ in range(n_samples)])
        weight_bound = batch_size * bandwidth * 1e9 / (params * 4)
        compute_bound = peak * 1e9 / (2 * params)
        bound = min(weight_bound, compute_bound)
        shape = f"batch {batch_size}" + (f" ({n_prompts} prompts x {n_samples} samples)" if n_samples > 1 else "")
        print(f"generation {shape}: bound {bound:.0f} tokens/s (weights read once per step {weight_bound:.0f}, "
              f"compute {compute_bound:.0f}); the rows' prefill {prefill / reps:.2f} s per call")
        for decode in engines:
            rate = tokens[decode] / elapsed[decode]
            if n_samples == 1:
                rates[decode, batch_size] = rate
            line = f"  {decode:>14}: {rate:.1f} tokens/s = {rate / bound:.2f}x the bound"
            if n_samples == 1 or decode == "generate":  # the static paths' own prefill is smaller: not subtracted
                decode_rate = tokens[decode] / max(elapsed[decode] - prefill, 1e-9)
                line += f"; decode alone {decode_rate:.1f} tokens/s = {decode_rate / bound:.2f}x"
            print(f"{line} ({tokens[decode]} tokens, {steps[decode]} steps, {elapsed[decode]:.1f} s)")
        old = tokens["generate"] / elapsed["generate"]
        ratios = ", ".join(f"{d} / generate {tokens[d] / elapsed[d] / old:.2f}x" for d in engines if d != "generate")
        print(f"  {ratios}; {load_average()}")
    if 1 in batches and 32 in batches:
        for decode in engines:
            print(f"generation batch 32 / batch 1 ({decode}): {rates[decode, 32] / rates[decode, 1]:.1f}x "
                  f"(goal >= 10x)")


if __name__ == "__main__":
    raise SystemExit(main())
