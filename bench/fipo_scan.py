"""FIPO's Future-KL: the blocked O(B*T) reverse scan against the reference's chunked matmul (O(B*T^2) FLOPs).

    python bench/fipo_scan.py [--rows 8] [--lengths 512 2048 8192] [--chunk 128] [--device cpu|cuda] [--repeats 3]

For each response length T: median wall time of ``recipe.fipo.discounted_future_sum`` and of the chunked-matmul form
kept as the literal reference in tests/unit/fipo_reference.py (fp32, same process, same inputs), their ratio, and
the largest difference between the two relative to the largest |F|. Measured, never asserted on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "unit"))

from fipo_reference import future_kl_chunked  # noqa: E402

from recipe.fipo import discounted_future_sum  # noqa: E402


def _chunked(x: torch.Tensor, gamma: float, chunk: int) -> torch.Tensor:
    # the reference's form, on the input's device (fipo_reference builds CPU tensors)
    if x.device.type == "cpu":
        return future_kl_chunked(x, gamma, chunk)
    b, t = x.shape
    out = torch.zeros_like(x)
    i = torch.arange(t, dtype=x.dtype, device=x.device).unsqueeze(1)
    for j0 in range(0, t, chunk):
        j = torch.arange(j0, min(j0 + chunk, t), dtype=x.dtype, device=x.device).unsqueeze(0)
        dist = j - i
        block = torch.where(dist >= 0, torch.tensor(gamma, dtype=x.dtype, device=x.device) ** dist.clamp(min=0), 0.0)
        out += x[:, j0:j0 + chunk] @ block.T
    return out


def _time(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--decay", type=float, default=32.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gamma = 2.0 ** (-1.0 / args.decay)
    g = torch.Generator().manual_seed(0)
    print(f"device={args.device} rows={args.rows} chunk={args.chunk} decay={args.decay} "
          f"threads={torch.get_num_threads()}")
    print(f"{'T':>7} {'scan s':>10} {'chunked s':>10} {'chunked/scan':>13} {'max rel diff':>13}")
    for t in args.lengths:
        x = (torch.randn(args.rows, t, generator=g) * 0.3).to(args.device)
        fast = discounted_future_sum(x, gamma)
        ref = _chunked(x, gamma, args.chunk)
        diff = float((fast - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        ts = _time(lambda: discounted_future_sum(x, gamma), args.repeats, args.device)
        tc = _time(lambda: _chunked(x, gamma, args.chunk), args.repeats, args.device)
        print(f"{t:>7} {ts:>10.4f} {tc:>10.4f} {tc / ts:>13.2f} {diff:>13.2e}")


if __name__ == "__main__":
    main()
