"""AdamW's three CPU kernels on a SmolLM2-135M-sized parameter set: the per-parameter loop (``foreach=False``),
``foreach`` (the actor's default, bit-identical to the loop) and ``fused`` (``actor.optimizer.implementation=fused``).

    python bench/adamw_variants.py [--steps 6] [--threads 2] [--dtype float32]

The parameters have SmolLM2-135M-Instruct's shapes (a LlamaForCausalLM built on the meta device from its config:
hidden 576, 30 layers, vocabulary 49,152, tied embeddings; 272 tensors, 134.5M parameters), random values, with
random gradients; float32 master weights as the actor trains them. Each step of each kernel is timed, the kernels
alternated step by step in one process (each order rotated), after one warm-up step that creates the state. Printed:
median seconds per step, the ratio to foreach and the machine's load average (a shared machine slows all three: the
ratio is the figure). Not asserted on: figures and ratios only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stalerl.core.hardware import cpu_isa  # noqa: E402

KERNELS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def smollm2_shapes() -> list[tuple[int, ...]]:
    """SmolLM2-135M-Instruct's trainable parameter shapes (its config.json), without allocating the weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [tuple(p.shape) for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per kernel (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = smollm2_shapes()
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen, dtype=dtype) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen, dtype=dtype) * 1e-3 for s in shapes]
    n = sum(p.numel() for p in start)
    flags = cpu_isa()
    print(f"AdamW on SmolLM2-135M's shapes: {len(shapes)} tensors, {n / 1e6:.1f}M {args.dtype} parameters, "
          f"{args.threads} threads, torch {torch.__version__}, CPU flags {' '.join(flags) or 'n/a'}")
    optimizers = {}
    for name, kw in KERNELS.items():
        params = [torch.nn.Parameter(p.clone()) for p in start]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizers[name] = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, **kw)
        optimizers[name].step()  # warm-up: creates exp_avg / exp_avg_sq
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    names = list(KERNELS)
    loads = []
    for step in range(args.steps):
        order = names[step % 3:] + names[:step % 3]
        for name in order:
            t0 = time.perf_counter()
            optimizers[name].step()
            times[name].append(time.perf_counter() - t0)
        loads.append(os.getloadavg()[0])
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    print(f"load average during the run: {min(loads):.1f}-{max(loads):.1f}")
    for name in names:
        print(f"  {name:>8}: median {med[name]:.3f} s per step (min {min(times[name]):.3f}), "
              f"{med[name] / med['foreach']:.2f}x foreach")
    final = {name: [p.detach() for p in opt.param_groups[0]["params"]] for name, opt in optimizers.items()}
    same = all(torch.equal(a, b) for a, b in zip(final["loop"], final["foreach"]))
    diff = max(float((a - b).abs().max()) for a, b in zip(final["foreach"], final["fused"]))
    print(f"after {args.steps + 1} steps: foreach == loop bit for bit: {same}; max |fused - foreach| = {diff:.2e}")


if __name__ == "__main__":
    main()
