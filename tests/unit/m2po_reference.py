"""A literal, obviously-correct M2PO Algorithm 1 on plain Python lists: the oracle for the fast implementation.

Algorithm 1 (Zheng, Zhao, Chen, ICLR 2026), line for line:

    T = { valid i : (A_i > 0 and d_i > 0) or (A_i < 0 and d_i < 0) }
    M_i = 1 for every valid i
    while T is non-empty and mean_{i in T} d_i^2 > tau:
        j = argmax_{i in T} d_i^2        (ties: the highest flat position, i.e. the later token)
        M_j = 0; remove j from T

d^2 is rounded to float32 (the implementation squares in fp32); means are taken in float64 with math.fsum.
No torch and no numpy here on purpose.
"""

from __future__ import annotations

import math
import struct
from typing import Sequence


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (ties to even), as a Python float; beyond float32's range that is
    +-inf, as IEEE rounding (and the implementation's float32 square) gives (``struct`` refuses to pack it)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def reference_m2po(d_rows: Sequence[Sequence[float]], a_rows: Sequence[Sequence[float]],
                   mask_rows: Sequence[Sequence[bool]], tau: float) -> dict:
    """Algorithm 1 over a (rows x cols) batch given as nested lists.

    ``d_rows`` are the log-ratios, already float32 values (e.g. ``tensor.float().tolist()``); padding entries are
    ignored whatever they hold. Returns keep (nested lists of bool, False on padding), in_t, and the diagnostics.
    """
    rows = len(mask_rows)
    cols = len(mask_rows[0]) if rows else 0
    # Flatten row-major: the position of a token is its index in this order.
    d, a, valid = [], [], []
    for r in range(rows):
        for c in range(cols):
            d.append(float(d_rows[r][c]))
            a.append(float(a_rows[r][c]))
            valid.append(bool(mask_rows[r][c]))
    n = len(d)
    sq = [f32(d[i] * d[i]) if valid[i] else 0.0 for i in range(n)]

    trust = []
    for i in range(n):
        if valid[i] and ((a[i] > 0 and d[i] > 0) or (a[i] < 0 and d[i] < 0)):
            trust.append(i)
    in_t = [False] * n
    for i in trust:
        in_t[i] = True

    keep = [valid[i] for i in range(n)]
    remaining = list(trust)
    m2_before = _mean([sq[i] for i in remaining]) if remaining else 0.0
    while remaining and _mean([sq[i] for i in remaining]) > tau:
        j = remaining[0]
        for i in remaining:
            if sq[i] > sq[j] or (sq[i] == sq[j] and i > j):
                j = i
        keep[j] = False
        remaining.remove(j)
    m2_after = _mean([sq[i] for i in remaining]) if remaining else 0.0

    num_valid = sum(valid)
    num_masked = sum(1 for i in range(n) if valid[i] and not keep[i])

    def unflatten(flat):
        return [flat[r * cols:(r + 1) * cols] for r in range(rows)]

    return {
        "keep": unflatten(keep),
        "in_t": unflatten(in_t),
        "num_valid": num_valid,
        "num_trust_region": len(trust),
        "num_masked": num_masked,
        "m2_before": m2_before,
        "m2_after": m2_after,
    }


def reference_loss(lp: Sequence[float], old: Sequence[float], adv: Sequence[float], keep: Sequence[bool],
                   valid: Sequence[bool]) -> float:
    """loss = -sum_i keep_i * A_i * exp(clamp(lp_i - old_i, -20, 20)) / N_valid over flat lists (0 when nothing
    is valid)."""
    n_valid = sum(1 for v in valid if v)

    def ratio(d: float) -> float:
        return math.exp(max(-20.0, min(20.0, d)))

    total = math.fsum(-adv[i] * ratio(lp[i] - old[i]) for i in range(len(lp)) if valid[i] and keep[i])
    return total / max(n_valid, 1)
