"""Training log-probs: the plain logits path against the chunked one (stalerl.core.chunked_logprob), peak memory and
time of a forward + backward in one process, at Qwen2's vocabulary (151,936).

* plain: ``token_logprobs(F.linear(h, W), ids)``, what the actor computed before: the model's head materialises the
  micro-batch's (tokens, vocab) logits, autograd keeps them (and the softmax) for backward;
* chunked: ``chunked_token_logprobs(h, W, ids)``: per-token log-prob and log-sum-exp only, logits recomputed one
  chunk at a time in backward (a few chunk sizes).

Peak memory is measured per variant: on CUDA ``torch.cuda.max_memory_allocated`` above what was allocated before;
on CPU the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` before each variant)
above the resident set before it. Time is the median of ``--reps`` forward + backward passes, the variants interleaved.
Ratios are against plain, in the same process.

Measured on the shared 2-core machine (torch 2.13.0+cpu, 1 thread, fp32, 512 tokens, load average ~20 from other
jobs): plain 1187 MiB / 25.1 s, chunked (27 tokens per chunk, the default) 47 MiB / 13.2 s: 0.04x memory, 0.53x time.

    python bench/logprob_memory.py                       # 512 tokens x hidden 64, CPU, fp32
    python bench/logprob_memory.py --tokens 4096 --dtype bfloat16 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stalerl.training.actor import token_logprobs
from stalerl.core.chunked_logprob import CHUNK_ELEMENTS, chunk_tokens_for, chunked_token_logprobs

VOCAB = 151_936


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakMemory:
    """Peak bytes allocated inside the block above the level at its start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS (Linux >= 4.0)
                f.write("5")
            self.start = _rss_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = _rss_kib("VmHWM") * 1024 - self.start


def step(fn, h0: torch.Tensor, w0: torch.Tensor, autocast: torch.autocast) -> None:
    h = h0.detach().requires_grad_()
    w = w0.detach().requires_grad_()
    with autocast:
        lp = fn(h, w)
    lp.sum().backward()
    del lp, h, w


def peak_memory(fn, h, w, autocast, device) -> float:
    step(fn, h, w, autocast)  # warm-up (allocator, kernels)
    with PeakMemory(device) as mem:
        step(fn, h, w, autocast)
    return mem.peak


def median_times(variants: dict, h, w, autocast, device, reps) -> dict[str, float]:
    """Interleaved (plain, chunked, ..., plain, chunked, ...): on a shared machine, load changes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(fn, h, w, autocast)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="response tokens in the micro-batch")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype (bf16: autocast over fp32 parameters, as actor.dtype=bfloat16)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-elements", type=int, nargs="*", default=[1 << 20, CHUNK_ELEMENTS, 1 << 24])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, args.tokens, args.hidden, generator=gen).to(device)
    w = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    logits_bytes = args.tokens * args.vocab * 4
    print(f"torch {torch.__version__}, {device.type}, {args.dtype}, {args.tokens} tokens x hidden {args.hidden} x "
          f"vocab {args.vocab} (one float32 logits tensor: {logits_bytes / 2**20:.0f} MiB), {args.threads} thread(s)")

    def plain(hh, ww):
        return token_logprobs(torch.nn.functional.linear(hh, ww), ids)

    variants = {"plain (full logits)": plain}
    for elements in args.chunk_elements:
        chunk = chunk_tokens_for(args.vocab, elements)
        default = " (default)" if elements == CHUNK_ELEMENTS else ""
        variants[f"chunked, {chunk} tokens/chunk{default}"] = (
            lambda hh, ww, chunk=chunk: chunked_token_logprobs(hh, ww, ids, chunk_tokens=chunk))
    peaks = {name: peak_memory(fn, h, w, autocast, device) for name, fn in variants.items()}
    times = median_times(variants, h, w, autocast, device, args.reps)
    base = "plain (full logits)"
    for name in variants:
        ratio = "" if name == base else (f"   memory {peaks[name] / max(1, peaks[base]):.3f}x  time "
                                         f"{times[name] / times[base]:.2f}x of plain")
        print(f"  {name:34s} peak {peaks[name] / 2**20:8.0f} MiB  time {times[name] * 1e3:8.1f} ms{ratio}")


if __name__ == "__main__":
    main()
