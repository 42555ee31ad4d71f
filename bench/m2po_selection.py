"""Benchmark M2PO's token selection (Algorithm 1) on realistic stale batches, on CPU or a GPU.

Compares, in one process and on the same tensors (each timed best of N, round-robin so that load from other
processes hits all alike; the spread is reported beside the best):

1. ours: ``recipe.m2po.select_m2po`` (one elementwise pass, then a radix select over the high tokens' float32 bit
   patterns: recipe/m2po/radix_select.py; no sort);
2. the full sort: a prefix-mean selection as AReaL and Trinity-RFT do it (stable-sort every trust-region d^2,
   cumsum, prefix mean, scatter back);
3. the floor: one elementwise pass over the same tokens, exp of the clamped log-ratio times the advantage, masked,
   summed (what any loss on these tokens reads);
4. the registered loss's forward (``compute_policy_loss_m2po``: input checks, selection, ratio, quadrant
   diagnostics, aggregation), against the same floor;
5. on CPU, the literal loop of Algorithm 1 (tests/unit/m2po_reference.py) on a small batch.

It checks that (1) and (2) choose the same mask, prints the machine (CPU model and ISA: AVX2, AVX512, AVX512-BF16,
AMX; or the GPU), the load before and after, the peak memory per size, and the ratios full_sort/ours and
ours/floor. Targets (issue 48): full_sort/ours >= 5 and ours/floor <= 3 idle (>= 2 under load).

    python bench/m2po_selection.py                                   # 1M and 8M valid tokens, CPU, 2 threads
    python bench/m2po_selection.py --sizes 1M,8M,64M --repeats 5 --json /tmp/m2po.json
    python bench/m2po_selection.py --device cuda --sizes 1M,8M,64M --json $OUT/m2po_selection.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import tempfile
import time
from typing import Callable, Optional

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe.m2po import compute_policy_loss_m2po, select_m2po  # noqa: E402

ISA_FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX512"), ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))


def make_batch(num_valid: int, *, width: int = 1024, tail_fraction: float = 0.04, zero_adv_rows: float = 0.1,
               seed: int = 0, device: str = "cpu", block_rows: int = 4096):
    """A stale GRPO-like mini-batch with exactly ``num_valid`` valid tokens, rows padded to ``width``.

    Response lengths are uniform in [width/4, width]; most |d| ~ N(0, 0.08) (typical |d| 0.05-0.1), a heavy tail of
    ``tail_fraction`` tokens with |d| uniform in [0.2, 2]; random signs. Advantages are constant per row with a random
    sign, ``zero_adv_rows`` of the rows have A = 0 (groups whose rewards were all equal). Padding holds NaN in the
    log-probs, as engines leave garbage there. Generated ``block_rows`` rows at a time, so that 64M tokens need no
    more than the batch itself.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = []
    total = 0
    while total < num_valid:
        n = int(torch.randint(width // 4, width + 1, (1,), generator=g))
        n = min(n, num_valid - total)
        lengths.append(n)
        total += n
    rows = len(lengths)
    lp = torch.empty(rows, width)
    old = torch.empty(rows, width)
    lengths_t = torch.tensor(lengths)
    mask = torch.arange(width).unsqueeze(0) < lengths_t.unsqueeze(1)
    for start in range(0, rows, block_rows):
        r = slice(start, min(rows, start + block_rows))
        shape = (r.stop - r.start, width)
        d = torch.randn(shape, generator=g) * 0.08
        tail = torch.rand(shape, generator=g) < tail_fraction
        tail_mag = 0.2 + 1.8 * torch.rand(shape, generator=g)
        tail_sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        d = torch.where(tail, tail_mag * tail_sign, d)
        old[r] = -torch.rand(shape, generator=g) * 3.0
        lp[r] = torch.where(mask[r], old[r] + d, torch.full_like(d, float("nan")))
    adv_row = torch.randn(rows, generator=g).abs() + 0.1
    adv_row = adv_row * torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0)
    adv_row = torch.where(torch.rand(rows, generator=g) < zero_adv_rows, torch.zeros_like(adv_row), adv_row)
    adv = adv_row.unsqueeze(1).expand(rows, width).contiguous()
    return lp.to(device), old.to(device), adv.to(device), mask.to(device)


@torch.no_grad()
def full_sort_select(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float):
    """The usual vectorised form: stable-sort every trust-region d^2, prefix means, keep the leading run <= tau."""
    valid = mask.bool()
    device = valid.device
    d = torch.where(valid, log_ratio.float(), torch.zeros((), dtype=torch.float32, device=device))
    sq = d * d
    in_t = valid & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))
    idx = in_t.flatten().nonzero().squeeze(1)
    vals = sq.flatten()[idx]
    sorted_vals, order = torch.sort(vals, stable=True)
    prefix = torch.cumsum(sorted_vals.double(), 0)
    counts = torch.arange(1, vals.numel() + 1, dtype=torch.float64, device=device)
    n_keep = int(((prefix / counts) <= tau).sum())
    keep_sorted = torch.arange(vals.numel(), device=device) < n_keep
    keep_t = torch.empty_like(keep_sorted)
    keep_t[order] = keep_sorted
    keep = valid.flatten().clone()
    keep[idx] = keep_t
    return keep.view_as(valid)


@torch.no_grad()
def floor_pass(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor):
    """The floor: one elementwise pass, exp of the clamped log-ratio times the advantage, masked, summed."""
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    return torch.where(mask, ratio * advantages, torch.zeros((), dtype=ratio.dtype, device=ratio.device)).sum()


def machine(device: str) -> dict:
    """What ran it: the CPU model and its ISA extensions from /proc/cpuinfo, or the GPU; torch; threads."""
    out = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "python": platform.python_version()}
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    out["cpu"] = model
    out["isa"] = [name for flag, name in ISA_FLAGS if flag in flags]
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def timeit(fns: dict[str, Callable], repeats: int, sync: Callable[[], None]) -> dict[str, list[float]]:
    """Wall times of each function, ``repeats`` times round-robin after one warm-up each."""
    for fn in fns.values():
        fn()
        sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def summary(ts: list[float]) -> dict[str, float]:
    best = min(ts)
    return {"best_s": best, "median_s": statistics.median(ts), "max_s": max(ts),
            "spread": (max(ts) - best) / best if best > 0 else 0.0}


def peak_memory_bytes(device: str) -> int:
    """Peak GPU memory allocated by torch since the last reset, or the process's peak resident set on CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def bench_size(num_valid: int, tau: float, repeats: int, device: str, with_loss: bool) -> dict:
    sync = (lambda: torch.cuda.synchronize(torch.device(device))) if device.startswith("cuda") else (lambda: None)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    lp, old, adv, mask = make_batch(num_valid, device=device)
    ours_sel = select_m2po(lp - old, adv, mask, tau)
    same = bool(torch.equal(ours_sel.keep_mask, full_sort_select(lp - old, adv, mask, tau)))
    if not same:
        raise SystemExit(f"MISMATCH at {num_valid} tokens: ours and the full sort chose different masks")
    fns = {
        "ours": lambda: select_m2po(lp - old, adv, mask, tau),
        "full_sort": lambda: full_sort_select(lp - old, adv, mask, tau),
        "floor": lambda: floor_pass(lp, old, adv, mask),
    }
    if with_loss:
        config = {"m2_threshold": tau}
        fns["loss_forward"] = lambda: compute_policy_loss_m2po(old, lp, adv, mask, config=config)
    times = timeit(fns, repeats, sync)
    row = {"valid_tokens": num_valid, "tokens": num_valid, "rows": mask.shape[0], "width": mask.shape[1],
           "trust_region_tokens": ours_sel.num_trust_region, "masked_tokens": ours_sel.num_masked,
           "m2_before": ours_sel.m2_before, "m2_after": ours_sel.m2_after, "masks_identical": same,
           **{name: summary(ts) for name, ts in times.items()}}
    best = {name: row[name]["best_s"] for name in times}
    row["full_sort_over_ours"] = best["full_sort"] / best["ours"]
    row["ours_over_floor"] = best["ours"] / best["floor"]
    if with_loss:
        row["loss_forward_over_floor"] = best["loss_forward"] / best["floor"]
    row["peak_memory_bytes"] = peak_memory_bytes(device)
    del lp, old, adv, mask
    return row


def print_row(row: dict) -> None:
    n = row["valid_tokens"]
    print(f"valid tokens {n:>11,d} (rows {row['rows']} x {row['width']}): |T| {row['trust_region_tokens']:,d} "
          f"({row['trust_region_tokens'] / n:.1%}), masked {row['masked_tokens']:,d} ({row['masked_tokens'] / n:.3%}),"
          f" m2_before {row['m2_before']:.4f}, m2_after {row['m2_after']:.4f}; masks identical: "
          f"{row['masks_identical']}; peak memory {row['peak_memory_bytes'] / 2**30:.2f} GiB")
    labels = {"ours": "ours (select_m2po)", "full_sort": "full sort + prefix mean", "floor": "elementwise floor",
              "loss_forward": "registered loss forward"}
    for name, label in labels.items():
        if name in row:
            s = row[name]
            print(f"  {label:26s} best {s['best_s'] * 1e3:10.2f} ms   median {s['median_s'] * 1e3:10.2f} ms   "
                  f"spread {s['spread']:6.1%}")
    line = f"  full_sort/ours = {row['full_sort_over_ours']:.2f}x   ours/floor = {row['ours_over_floor']:.2f}x"
    if "loss_forward_over_floor" in row:
        line += f"   loss forward/floor = {row['loss_forward_over_floor']:.2f}x"
    print(line)


def load_reference():
    path = ROOT / "tests" / "unit" / "m2po_reference.py"
    spec = importlib.util.spec_from_file_location("m2po_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_loop(num_valid: int, tau: float, repeats: int) -> dict:
    ref = load_reference()
    lp, old, adv, mask = make_batch(num_valid, width=256, seed=1)
    d = torch.where(mask, lp - old, torch.zeros(()))
    d_rows, a_rows, m_rows = d.tolist(), adv.tolist(), mask.tolist()
    expected = ref.reference_m2po(d_rows, a_rows, m_rows, tau)
    same = select_m2po(d, adv, mask, tau).keep_mask.tolist() == expected["keep"]
    if not same:
        raise SystemExit(f"MISMATCH at {num_valid} tokens: ours and the literal loop chose different masks")
    times = timeit({"loop": lambda: ref.reference_m2po(d_rows, a_rows, m_rows, tau),
                    "ours": lambda: select_m2po(d, adv, mask, tau)}, repeats, lambda: None)
    loop, ours = min(times["loop"]), min(times["ours"])
    print(f"literal loop, {num_valid:,d} valid tokens (|T| {expected['num_trust_region']}, masked "
          f"{expected['num_masked']}; masks identical: {same}): loop {loop * 1e3:.2f} ms, ours {ours * 1e3:.3f} ms, "
          f"loop/ours = {loop / ours:.0f}x")
    return {"valid_tokens": num_valid, "loop_s": loop, "ours_s": ours, "masks_identical": same}


def parse_sizes(items: list[str]) -> list[int]:
    """'1M,8M,64M' or '1000000 8000000' (k, M, G suffixes, decimal)."""
    scale = {"k": 10 ** 3, "K": 10 ** 3, "m": 10 ** 6, "M": 10 ** 6, "g": 10 ** 9, "G": 10 ** 9}
    sizes = []
    for item in items:
        for part in filter(None, item.split(",")):
            part = part.strip()
            factor = scale.get(part[-1], 1)
            number = part[:-1] if part[-1] in scale else part
            try:
                sizes.append(int(float(number) * factor))
            except ValueError:
                raise SystemExit(f"--sizes: {part!r} is not a token count; expected e.g. 1M,8M,64M or 1000000")
    return sizes


def write_json_atomic(path: str, payload: dict) -> None:
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, target)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU (default 2)")
    parser.add_argument("--sizes", nargs="+", default=["1M,8M"], help="valid tokens, e.g. 1M,8M,64M (default 1M,8M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the best is reported (default 5)")
    parser.add_argument("--tau", type=float, default=0.04)
    parser.add_argument("--no-loss", action="store_true", help="skip the registered loss's forward")
    parser.add_argument("--loop-tokens", type=int, default=2000, help="batch size for the literal loop (CPU; 0: skip)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON here (atomically)")
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch.cuda.is_available() is False here; use --device cpu")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    info = machine(args.device)
    load_before = os.getloadavg()
    where = info.get("gpu") or f"{info['cpu']} ({', '.join(info['isa']) or 'no AVX2'})"
    print(f"{where}; torch {info['torch']}, {args.device}, threads {info['threads']} of {info['cpu_count']} CPUs; "
          f"tau {args.tau}; best of {args.repeats}; load (1/5/15 min) {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}")
    rows = []
    for n in sizes:
        row = bench_size(n, args.tau, args.repeats, args.device, not args.no_loss)
        print_row(row)
        rows.append(row)
    loop = bench_loop(args.loop_tokens, args.tau, args.repeats) if args.loop_tokens and args.device == "cpu" else None
    load_after = os.getloadavg()
    print(f"load after (1/5/15 min) {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    largest = max(rows, key=lambda r: r["valid_tokens"])
    speedup, overhead = largest["full_sort_over_ours"], largest["ours_over_floor"]
    print(f"targets at {largest['valid_tokens']:,d}: full_sort/ours {speedup:.2f}x (>= 5 idle, >= 2 loaded), "
          f"ours/floor {overhead:.2f}x (<= 3)")
    payload = {"bench": "m2po_selection", "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
               "machine": info, "tau": args.tau, "repeats": args.repeats, "load_before": list(load_before),
               "load_after": list(load_after), "sizes": rows, "literal_loop": loop}
    if args.json:
        write_json_atomic(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
