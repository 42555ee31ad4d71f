"""Where Algorithm 1 stops, found without sorting: a radix select over the bit patterns of the squared log-ratios.

The problem. The "high" tokens of the trust region (d^2 > tau; recipe/m2po/algorithm.py) sorted ascending are
s_1 <= s_2 <= ... (ties by position). The selection keeps the leading run of k with

    D(k):  (low_sum + C_k) / (low_count + k) <= tau,   C_k = s_1 + ... + s_k,

evaluated in float64 exactly as the sorting implementation evaluates it (``_sort_decision`` in algorithm.py), and masks
the rest. K, the length of that run, only depends on *which value* the (K+1)-th token holds and how many of its equal
values come first, so it can be found without ordering the tokens:

1. A non-negative float32's int32 bit pattern orders like the float. Three histogram passes over the high tokens'
   patterns (bits 30-20, 19-10, 9-0: 2048, 1024, 1024 buckets, each with a count and a float64 sum) narrow the
   boundary to one exact value v*: each pass evaluates D at every bucket's end and keeps the first bucket whose end
   fails. The number of passes is fixed, and every step is a tensor operation: no host synchronisation on a GPU.
2. Among the t tokens equal to v*, the number kept, j, is the largest with D(c0 + j) (c0 high tokens lie below v*,
   with sum C0, and C_{c0+j} = C0 + j v*), found by four rounds of a 1024-way search over j (t < 2^40).
3. The tie rule is Algorithm 1's: the first j tokens equal to v* in (rank, row-major position) order are kept.

Why the decision is bit-identical to the sort's. Each high value is a multiple of u, the unit in the last place of the
smallest float32 above tau, so while a sum of high values stays below 2^53 u every float64 partial sum of them is
exact, in any order: the bucket sums (one exponent per bucket, fewer than 2^29 tokens), their running sums, and the
sorting implementation's cumsum all hold the same exact C_k. ``low_sum`` is the same tensor in both. So D(k) is the
same float64 expression of the same numbers, bit for bit, for every k <= K + 1, provided:

- C_K < 2^53 u (checked: the kept mean is <= tau, so this holds below 2^29 tokens for any tau);
- fewer than 2^29 valid tokens (checked: each bucket sum exact);
- D(1..K) all hold, not only at the bucket ends the search looked at. Exact means rise up to K (each added s exceeds
  tau, and the mean at K is below the next float32 above tau), so this holds (checked) when every low_sum + C_k is
  exact in float64 (each D(k) then rounds a rising exact mean once: the common case, ties of the mean with tau
  included), or when the computed mean at K is below tau (1 - 2^-40), far more than the float64 rounding of a mean
  away, and tau is not within 2^-40 below a float32 (where the means can creep up by less than their rounding);
- D(K + 1) fails: the last round evaluates it from C_K + v*, one rounding of an exact sum, as the cumsum does.

When a check fails (a kept mean within 2^-40 of tau on an inexact low sum, tau just below a float32, pathological
magnitudes) :func:`find_boundary` says so and the caller sorts instead, so the result is the sorting
implementation's in every case. The checks are read with the result: on a GPU the sort costs host syncs only then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

# (shift, bits) of the three histogram passes over the 31 bits of a non-negative float32 (the sign bit is 0). The
# first pass's buckets each hold one exponent (8 exponent bits and 2 mantissa bits), so each bucket sum is exact.
LEVELS = ((20, 11), (10, 10), (0, 10))
# The tie search: ROUNDS rounds of a FANOUT-way split cover up to FANOUT**ROUNDS tied tokens.
FANOUT = 1024
ROUNDS = 4
# Margins of the exactness conditions (see the module docstring): far above float64's rounding of a mean (2^-52).
NEAR_TAU = 2.0 ** -40
MAX_TOKENS = 1 << 29


@dataclass
class Boundary:
    """Where the selection stops (0-dim tensors on the tokens' device; sums over all ranks of the group).

    A high token with pattern > ``key`` is masked, one with pattern < ``key`` kept, and of the tokens equal to ``key``
    the first ``keep_ties`` (in rank, then row-major order) are kept. ``exact`` is False when the decision could
    differ from the sort's (see the module docstring); the caller must then use the sort.
    """

    key: torch.Tensor  # int32 bit pattern of v*
    keep_ties: torch.Tensor  # int64 j
    kept: torch.Tensor  # float64: K, high tokens kept
    kept_sum: torch.Tensor  # float64: C_K
    high: torch.Tensor  # float64: number of high tokens
    high_sum: torch.Tensor  # float64: their sum
    exact: torch.Tensor  # bool


def float32_floor(tau: float) -> float:
    """The largest float32 value <= tau. For a float32 x, ``x > tau`` (exact) iff ``x > float32_floor(tau)``, and the
    right-hand comparison is exact in float32 (comparing a float32 tensor with ``tau`` itself rounds tau first)."""
    t32 = torch.tensor(tau, dtype=torch.float32)
    if float(t32) > tau:
        t32 = torch.nextafter(t32, torch.tensor(-math.inf, dtype=torch.float32))
    return float(t32)


def _next_float32(x: float) -> float:
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(math.inf, dtype=torch.float32)))


def _ulp_of_float32(x: float) -> float:
    """The spacing of float32 values at x (> 0, finite): every float32 >= x is a multiple of it."""
    if x >= 2.0 ** -126:
        return 2.0 ** (math.frexp(x)[1] - 1 - 23)
    return 2.0 ** -149


def _last_bit(x: torch.Tensor) -> torch.Tensor:
    """The value of the lowest set bit of a finite float64 x >= 0 (inf for 0): x is a multiple of it."""
    bits = x.reshape(1).view(torch.int64).reshape(())
    biased = bits >> 52
    mantissa = (bits & ((1 << 52) - 1)) | torch.where(biased > 0, 1 << 52, 0)
    exponent = torch.where(biased > 0, biased - 1075, -1074)
    lowest = (mantissa & -mantissa).to(torch.float64)
    return torch.where(mantissa > 0, torch.ldexp(lowest, exponent.to(torch.float64)),
                       torch.full_like(x, math.inf))


def within(low_sum: torch.Tensor, low_count: torch.Tensor, tau: float, count: torch.Tensor,
           total: torch.Tensor) -> torch.Tensor:
    """D: is the mean of the low tokens and ``count`` high ones (sum ``total``) <= tau, in float64 as the sort's
    prefix means are computed. With no high token the answer is yes (Algorithm 1 never tests it: low tokens have
    d^2 <= tau)."""
    return (count == 0) | ((low_sum + total) / (low_count + count) <= tau)


def _histogram(keys: torch.Tensor, values: torch.Tensor, in_range: torch.Tensor, bucket: torch.Tensor,
               buckets: int) -> torch.Tensor:
    """(2, buckets) float64: count and sum of ``values`` per bucket, over the entries in range."""
    # out of range: into slots dropped below, spread by the key's low bits (one slot would serialise a GPU's atomics)
    index = torch.where(in_range, bucket, buckets + (keys & (buckets - 1)).to(torch.int64))
    hist = torch.zeros(2, 2 * buckets, dtype=torch.float64, device=keys.device)
    hist[0].index_add_(0, index, torch.ones((), dtype=torch.float64, device=keys.device).expand(index.numel()))
    hist[1].index_add_(0, index, values)
    return hist[:, :buckets].contiguous()  # contiguous: all_reduce reads the storage, not the view


@torch.no_grad()
def find_boundary(keys: torch.Tensor, zeros: torch.Tensor, low_sum: torch.Tensor, low_count: torch.Tensor,
                  num_valid: torch.Tensor, tau: float, *, group: Optional[Any] = None,
                  narrow: bool = False) -> Boundary:
    """The boundary of Algorithm 1 over the high tokens' float32 bit patterns ``keys`` (int32, 1-D, local).

    ``keys`` may hold zeros that are not high tokens (an uncompacted pass: ``zeros`` of them, an int64 0-dim tensor);
    a high token's pattern is never 0 (its value exceeds tau >= 0). ``low_sum``, ``low_count`` and ``num_valid`` are
    float64 0-dim tensors over all ranks. With ``group``, every rank calls this and gets the same boundary.
    ``narrow``: drop the tokens outside the chosen bucket after each pass (a data-dependent size: for CPU, where it
    costs no host synchronisation and the later passes then read a few tokens).
    """
    device = keys.device
    f64 = torch.float64
    values = keys.view(torch.float32).to(f64)
    prefix = torch.zeros((), dtype=torch.int64, device=device)
    base_count = torch.zeros((), dtype=f64, device=device)
    base_sum = torch.zeros((), dtype=f64, device=device)
    zero1 = torch.zeros(1, dtype=f64, device=device)
    high = high_sum = ties = None
    for level, (shift, bits) in enumerate(LEVELS):
        buckets = 1 << bits
        in_range = (keys >> (shift + bits)).to(torch.int64) == prefix
        if narrow and level > 0:  # keep only the chosen bucket's tokens for the next passes
            keys, values = keys[in_range], values[in_range]
            in_range = torch.ones_like(keys, dtype=torch.bool)
        bucket = ((keys >> shift) & (buckets - 1)).to(torch.int64)
        hist = _histogram(keys, values, in_range, bucket, buckets)
        # the zeros that are not high tokens sit in bucket 0 while the prefix is 0
        hist[0, 0] -= torch.where(prefix == 0, zeros.to(f64), torch.zeros((), dtype=f64, device=device))
        if group is not None:
            torch.distributed.all_reduce(hist, group=group)
        counts, sums = hist[0], hist[1]
        if level == 0:
            high, high_sum = counts.sum(), sums.sum()
        run_count = torch.cat([zero1, counts.cumsum(0)])
        run_sum = torch.cat([zero1, sums.cumsum(0)])
        ok = within(low_sum, low_count, tau, base_count + run_count[1:], base_sum + run_sum[1:])
        # the first bucket whose end fails holds the boundary (the last one if none fails: everything is kept)
        chosen = ok.to(torch.int64).cumprod(0).sum().clamp(max=buckets - 1)
        base_count = base_count + run_count[chosen]
        base_sum = base_sum + run_sum[chosen]
        ties = counts[chosen]
        prefix = (prefix << bits) | chosen

    key = prefix.to(torch.int32)
    v = key.reshape(1).view(torch.float32).to(f64).reshape(())
    # j in [lo, hi): D(c0 + lo) holds, D(c0 + hi) fails or hi = ties + 1
    lo = torch.zeros((), dtype=torch.int64, device=device)
    hi = ties.to(torch.int64) + 1
    steps = torch.arange(1, FANOUT + 1, device=device, dtype=torch.int64)
    for _ in range(ROUNDS):
        step = (hi - lo + FANOUT - 1) // FANOUT
        cand = lo + step * steps
        cand64 = cand.to(f64)
        ok = (cand < hi) & within(low_sum, low_count, tau, base_count + cand64, base_sum + cand64 * v)
        run = ok.to(torch.int64).cumprod(0).sum()
        lo, hi = lo + run * step, torch.minimum(lo + (run + 1) * step, hi)
    keep_ties = lo
    j64 = keep_ties.to(f64)
    kept = base_count + j64
    kept_sum = base_sum + torch.where(keep_ties > 0, j64 * v, torch.zeros((), dtype=f64, device=device))

    exact = _exact(tau, low_sum, low_count, num_valid, kept, kept_sum, high, keep_ties, ties)
    return Boundary(key=key, keep_ties=keep_ties, kept=kept, kept_sum=kept_sum, high=high, high_sum=high_sum,
                    exact=exact)


def _exact(tau: float, low_sum: torch.Tensor, low_count: torch.Tensor, num_valid: torch.Tensor, kept: torch.Tensor,
           kept_sum: torch.Tensor, high: torch.Tensor, keep_ties: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The conditions under which the boundary is provably the sort's (module docstring), as one bool tensor."""
    above = _next_float32(float32_floor(tau))  # the smallest value a high token can hold
    unit = _ulp_of_float32(above) if math.isfinite(above) else math.inf  # every high value is a multiple of it
    mean_kept = (low_sum + kept_sum) / (low_count + kept).clamp(min=1)
    # D(1..K) all hold if every low_sum + C_k (k <= K) is exact (multiples of the smaller of low_sum's last bit and
    # u, fewer than 2^53 of them: each D(k) then rounds its exact mean once, and those rise with k), or if the kept
    # mean is clear of tau by more than its rounding and tau is not just below a float32 (where means can creep up
    # by less than their rounding).
    exact_means = (low_sum + kept_sum) < 2.0 ** 53 * torch.minimum(_last_bit(low_sum), torch.full_like(low_sum, unit))
    clear_of_tau = exact_means | (kept == 0)
    if tau == 0 or above > tau * (1 + NEAR_TAU):
        clear_of_tau = clear_of_tau | (mean_kept < tau * (1 - NEAR_TAU))
    consistent = (keep_ties < ties) | (kept == high)  # a failing D(K + 1) was seen, or everything is kept
    return clear_of_tau & consistent & (kept_sum < 2.0 ** 53 * unit) & (num_valid < MAX_TOKENS)
