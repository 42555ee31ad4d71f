"""Literal slow references for recipe.fipo, written independently of the vectorised code.

- :func:`future_kl_chunked`: the reference implementation's form (the authors' verl code and the TRL port): for
  each column chunk [j0, j1) a (T x chunk) decay block with gamma^(j-i) where j >= i, accumulated as a matmul.
- :func:`fipo_loop`: per row, per token, in Python floats (fp64), following the spec line by line. Threshold
  decisions use the fp32 log-ratio values and fp32(ln c), as the module documents.
"""

from __future__ import annotations

import math

import torch


def future_kl_chunked(x: torch.Tensor, gamma: float, chunk: int) -> torch.Tensor:
    b, t = x.shape
    out = torch.zeros(b, t, dtype=x.dtype)
    i = torch.arange(t, dtype=x.dtype).unsqueeze(1)
    for j0 in range(0, t, chunk):
        j1 = min(j0 + chunk, t)
        j = torch.arange(j0, j1, dtype=x.dtype).unsqueeze(0)
        dist = j - i  # (T, chunk)
        block = torch.where(dist >= 0, torch.tensor(gamma, dtype=x.dtype) ** dist.clamp(min=0),
                            torch.zeros((), dtype=x.dtype))
        out += x[:, j0:j1] @ block.T
    return out


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def fipo_loop(old, new, adv, mask, *, decay_rate=32.0, c=10.0, eps_f=0.2, high_only=True, safety=10.0,
              eps_low=0.2, eps_high=0.2):
    """Returns (loss as a token-mean over the post-drop mask, weights (list of rows), kept rows, metrics)."""
    gamma = 2.0 ** (-1.0 / decay_rate)
    log_c, log_s = _f32(math.log(c)), _f32(math.log(safety))
    bsz, width = mask.shape
    d32 = (new.float() - old.float())  # fp32, as the code computes it
    total, count = 0.0, 0
    weights, kept = [], []
    raw_sum, n_valid, n_up, n_low, n_drop = 0.0, 0, 0, 0, 0
    for b in range(bsz):
        valid = [bool(mask[b, t]) for t in range(width)]
        d = [max(-20.0, min(20.0, float(d32[b, t]))) if valid[t] else 0.0 for t in range(width)]
        a = float(adv[b, 0]) if width else 0.0
        row_w = []
        for t in range(width):
            fkl = 0.0
            for k in range(t, width):
                if valid[k] and d[k] <= log_c:
                    fkl += gamma ** (k - t) * d[k]
            w_raw = math.exp(fkl) if fkl < 700 else math.inf
            if eps_f == 0.0:
                lo, hi = None, 10.0
            else:
                lo, hi = (1.0 if high_only else 1.0 - eps_f), 1.0 + eps_f
            w = min(w_raw, hi) if lo is None else min(max(w_raw, lo), hi)
            if a < 0 and d[t] > log_s:
                w = min(max(w, 0.8), 1.0)
            row_w.append(w)
            if valid[t]:
                n_valid += 1
                raw_sum += math.exp(min(fkl, 20.0))
                n_up += w >= hi
                n_low += lo is not None and w <= lo
        low_clip = sum(1 for t in range(width) if valid[t] and a < 0 and d[t] > log_c)
        keep = low_clip <= 1
        n_drop += not keep
        kept.append(keep)
        weights.append(row_w)
        if not keep:
            continue
        for t in range(width):
            if not valid[t]:
                continue
            r = math.exp(d[t])
            ah = a * row_w[t]
            lc = max(-ah * r, -ah * min(max(r, 1 - eps_low), 1 + eps_high))
            if ah < 0:
                lc = min(lc, -ah * c)
            total += lc
            count += 1
    loss = total / max(count, 1)
    nv = max(n_valid, 1)
    metrics = {"fipo/influence_weights_mean_raw": raw_sum / nv, "fipo/influence_weight_clip_ratio_upper": n_up / nv,
               "fipo/influence_weight_clip_ratio_lower": n_low / nv,
               "fipo/sequence_drop_ratio": n_drop / max(bsz, 1)}
    return loss, weights, kept, metrics
