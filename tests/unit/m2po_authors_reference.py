"""A literal, slow reference of the M2PO authors' released ``compute_m2po_policy_loss`` (Infini-AI-Lab/M2PO @ af54a3e),
as shared/reference/m2po-algorithm.md section 2.3 describes it: token by token, their solver loop as written.

Two of their bugs are fixed here exactly as in recipe.m2po_authors (marked FIX): a budget <= 1e-12 does not crash,
and sqrt never sees a negative number. Per-token values are float32 (their tensors), sums Python floats.
"""

from __future__ import annotations

import math

import torch


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def solve_tau_from_sorted(v_sorted: list[float], budget: float) -> tuple[float, float, float]:
    """Their ``_solve_tau_from_sorted_delta2`` as a loop: returns (ratio low, ratio high, tau_c or nan)."""
    n = len(v_sorted)
    if n == 0:
        return 0.0, 1e5, math.nan
    m2_now = 0.0
    for x in v_sorted:
        m2_now += x
    m2_now /= n
    if m2_now <= budget + 1e-12:
        return 0.0, 1e5, math.nan
    s = 0.0
    k = n - 1  # FIX: a k always exists here (the loop reaches it by k = n - 1); theirs returned a bare float at
    #            budget <= 1e-12 and crashed in the caller
    for i in range(n):
        s += v_sorted[i]
        if s + (n - i - 1) * v_sorted[i] >= budget * n:
            k = i
            break
    tau_c = math.sqrt(max(v_sorted[k - 1] - 1e-12, 0.0)) if k > 0 else 0.0  # FIX: max(., 0)
    return math.exp(-tau_c), math.exp(tau_c), tau_c


def reference_m2po_authors(d_rows, a_rows, m_rows, budget: float) -> dict:
    """Loss value, per-token 'gradient survives' flags and counts for one batch (lists of rows)."""
    tokens = [(i, j) for i, row in enumerate(m_rows) for j, ok in enumerate(row) if ok]
    ratio, in_t, v = {}, {}, []
    for i, j in tokens:
        d = _f32(d_rows[i][j])
        r = torch.exp(d.clamp(-20.0, 20.0))
        a = a_rows[i][j]
        ratio[i, j] = r
        in_t[i, j] = (a > 1e-12 and bool(r > 1.0 + 1e-12)) or (a < -1e-12 and bool(r < 1.0 - 1e-12))
        if in_t[i, j]:
            v.append(float(d * d))
    low, high, tau_c = solve_tau_from_sorted(sorted(v), budget)
    lo32, hi32 = _f32(low), _f32(high)
    total, clipped = 0.0, []
    for i, j in tokens:
        a = _f32(a_rows[i][j])
        r = ratio[i, j]
        unclipped = -a * r
        clamped = -a * torch.clamp(r, lo32, hi32)
        total += float(torch.maximum(unclipped, clamped))
        if bool(clamped > unclipped):
            clipped.append((i, j))
    n_valid = len(tokens)
    return {"loss": total / max(n_valid, 1), "clipped": clipped, "low": low, "high": high, "tau_c": tau_c,
            "num_trust_region": sum(in_t.values()), "m2_before": (sum(v) / len(v)) if v else 0.0}
