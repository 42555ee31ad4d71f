"""Where the CPU's bf16 time goes: one matrix product per memory layout, bf16 against float32, on this CPU.

On a CPU without bf16 units (no AMX-BF16 / AVX512-BF16) torch emulates bf16 products, and how slow that is depends
on the operands' layout: a training step's backward multiplies transposed views (grad_input = grad_out @ W, grad_W =
grad_out^T @ x), so the layouts a forward never meets decide the step. SmolLM2-135M's shapes: 4 rows of 100 tokens
(M = 400) through its MLP (576 -> 1536) and its tied head (576 -> 49152). Printed per layout: float32 ms, bf16 ms,
bf16 / float32, and bf16 computed as float32 then rounded (the same inputs, another rounding of the sum) / float32.
Each figure is the best of --repeats, in one process; nothing is asserted (times depend on the machine and its load).

    python bench/cpu_bf16_matmul.py
    python bench/cpu_bf16_matmul.py --threads 2 --repeats 5
    python bench/cpu_bf16_matmul.py --only mlp          # seconds: the head's bf16 products take minutes on AVX2
"""

from __future__ import annotations

import argparse
import time

import torch

from stalerl.core.hardware import BF16_CPU_FLAGS, cpu_flags, cpu_isa

SHAPES = {"mlp 576->1536": (400, 576, 1536), "head 576->49152": (400, 576, 49152)}


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def operands(m: int, k: int, n: int, dtype: torch.dtype, a_t: bool, b_t: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(m x k) @ (k x n); a transposed operand is the transpose of a contiguous tensor, as autograd hands it over."""
    a = torch.randn(k, m, dtype=dtype).t() if a_t else torch.randn(m, k, dtype=dtype)
    b = torch.randn(n, k, dtype=dtype).t() if b_t else torch.randn(k, n, dtype=dtype)
    return a, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=sorted({k.split()[0] for k in SHAPES}), help="one of the shapes")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    flags = cpu_flags()
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    isa = ", ".join(cpu_isa(flags)) or "neither AVX2 nor AVX512"
    print(f"torch {torch.__version__}, {a.threads} thread(s), {isa}, bf16 units: {', '.join(native) or 'none'}")
    print(f"{'shape':<18}{'layout':<9}{'fp32 ms':>9}{'bf16 ms':>10}{'bf16/fp32':>11}{'via fp32/fp32':>15}")
    for name, (m, k, n) in SHAPES.items():
        if a.only and not name.startswith(a.only):
            continue
        for layout, (a_t, b_t) in {"A B": (False, False), "A^T B": (True, False), "A B^T": (False, True),
                                   "A^T B^T": (True, True)}.items():
            x32, y32 = operands(m, k, n, torch.float32, a_t, b_t)
            x16, y16 = operands(m, k, n, torch.bfloat16, a_t, b_t)
            f32 = best_ms(lambda: torch.mm(x32, y32), a.repeats)
            b16 = best_ms(lambda: torch.mm(x16, y16), a.repeats)
            via = best_ms(lambda: torch.mm(x16.float(), y16.float()).to(torch.bfloat16), a.repeats)
            print(f"{name:<18}{layout:<9}{f32:>9.1f}{b16:>10.1f}{b16 / f32:>11.1f}{via / f32:>15.2f}")


if __name__ == "__main__":
    main()
