"""The GPU check's numerics (scripts/gpu_check.sh, part "numerics"): results computed on the device, each compared with
a reference under a tolerance stated per dtype; one JSON object with every comparison, its tolerance and pass/fail.

1. **Policy losses and their gradients** (``recipe.registry``: ``m2po``, ``fipo``, ``vanilla`` = PPO clip) on one
   fixed batch (16 rows x up to 64 tokens, rows of different lengths, NaN on padding, a few large log-ratios so
   M2PO masks, PPO clips and FIPO drops a row), computed on the device against a **CPU float64 reference**: the
   literal references of the unit tests (``tests/unit/m2po_reference.py``'s Algorithm 1 loop and loss,
   ``tests/unit/fipo_reference.py``'s per-token loop; a per-token PPO-clip loop here), in Python floats, with their
   gradient with respect to ``log_prob`` in closed form. The batch's values are chosen on a grid (log-probs on
   multiples of 2^-10, log-ratios of 2^-12) so that ``log_prob - old_log_prob`` is exact in float32: the float32
   run and the reference see the same log-ratios and the same discrete decisions (M2PO's mask, PPO's clip, FIPO's
   drop), which are compared exactly (tolerance 0). ``bfloat16``: log-probs computed in bf16 (a bf16
   log-softmax of bf16-rounded logits whose exact log-softmax is a float64 batch, :func:`bf16_batch`) are fed as
   bf16 tensors into the loss and its decisions, which are compared with the float64 reference on the *exact*
   log-probs: the log-probs within their rounding bound, no decision within rounding reach of its threshold (so
   the decisions must be exact), the loss within the bound those roundings allow (:func:`bf16_loss_bound`); the
   gradient, returned in bf16, equals the float64 reference at the bf16 inputs rounded to bf16.
2. **Chunked vs plain log-probs** (``stalerl.core.chunked_logprob``, as in tests/unit/test_chunked_logprob.py) at
   SmolLM2-135M's head shape (hidden 576, vocab 49,152; CPU dry mode: hidden 64, vocab 4,096), values and gradients
   (hidden states, weight), in float32 and under bf16 autocast, with the device's chunk and a small chunk (several
   chunks and a remainder), and against a float64 reference computed on the same device.
3. **One optimizer step of ``fsdp:d1`` against ``torch:d1``** (as tests/unit/test_fsdp.py does with two gloo ranks):
   the tiny Qwen2 policy, one stale M2PO batch, SGD (the update is lr x the clipped gradient), in float32 and bf16;
   FSDP2 sharded over a one-rank process group (NCCL on CUDA, gloo on CPU; the runtime's ``fsdp:d1`` runs the torch
   engine, so the check shards explicitly to run FSDP2's code on the device). Deterministic algorithms are on.

Tolerances (``u`` = float32 unit roundoff 2^-24, ``K`` = terms in a dot product, ``S`` = the sum of the terms'
magnitudes, e.g. ``|h| @ |W|^T``); the numbers, with their derivation, are in :data:`TOLERANCES` and repeated in
each entry's ``rule``:

- losses, float32: ``|loss - ref| <= 2e-5 * sum|per-token loss| / N`` (per-token exp/mul rounding of a few ulp and
  a summation over N <= 1024 tokens: a tree sum errs by ~log2(N) u = 6e-7, a serial one by at most N u = 6e-5 in the
  worst case, ~sqrt(N) u = 2e-6 typically);
- losses fed log-probs computed in bf16 (u16 = 2^-8), against the reference on the exact log-probs: each log-prob
  within ``e_t = u16 |z_id| + e^(2m) sum_v p_v u16 |z_v| + 8 u (1 + max|z|) + u16 (|lp| + that)`` (a bf16
  log-softmax of bf16-rounded logits z, :func:`bf16_logprobs`), so each log-ratio within ``delta_t = e(lp_t) +
  e(old_t)``; decisions equal to the reference's on the bf16 inputs and within :func:`bf16_decision_slack` (the
  decisions within delta of a threshold) of the exact ones; the loss within ``|ref(bf16 inputs) - ref| + 2e-5 S``
  (the inputs' effect, in float64, and the float32 arithmetic), that effect within the a-priori
  :func:`bf16_loss_bound`;
- gradients w.r.t. ``log_prob``, per element, relative to ``max(|g_ref|, 1e-6 max|g_ref|)``: float32 ``1e-5``
  (-A r / N: 3-4 roundings, 2.4e-7); FIPO ``max(1e-5, 2 T u max_t sum_k gamma^(k-t) |d_k|)`` (its influence weight
  exp(future KL) carries the float32 rounding of a discounted sum over up to T tokens); bf16: ``2^-8`` more (the
  gradient comes back rounded to bf16, whose unit roundoff is 2^-8);
- log-probs, per element, ``|a - b| <= bound + 1e-7``, with ``eps_t`` a bound on token t's logit error and
  ``moved(eps)`` what it does to the gradients through the softmax (``|d(dL/dlogit_tv)| <= |go_t| / T p_tv 2 eps_t``,
  then ``@ |W|`` for the hidden states, ``^T @ |h|`` for the weight):
  float32 ``eps_t = 4 sqrt(K) u S_t`` (the probabilistic bound lambda sqrt(K) u S of a K-term sum, lambda = 4,
  Higham & Mary 2019; TF32 would exceed it): chunked vs plain ``4 eps_t`` for the log-probs and
  ``2 (4 sqrt(K') u S + moved(eps))`` for a gradient summed over K' terms; each against float64 ``2 eps_t`` and
  ``4 sqrt(N) u S + moved(eps)`` for the weight gradient;
  bf16 autocast, chunked vs plain: the unit test's ``2^-7 |logit|max / T`` and ``2^-7 S + moved(2^-7 |logit|max_t /
  T)`` (one bf16 rounding, 2^-8, of a logit or a partial sum on either side); against float64 ``2 eps_t`` with
  ``eps_t = 1.5 x 2^-7 S_t`` (bf16-rounded inputs and logit) and ``2^-6 S + moved(eps)`` for the weight gradient (the
  unit test's ``4 U_BF16``);
- ``fsdp:d1`` vs ``torch:d1``: ``||update_fsdp - update_torch|| / ||update_torch||`` (SGD: the relative difference of
  the clipped gradients) <= 1e-5 in float32 (tests/unit/test_fsdp.py's UPDATE_TOL: the same operations, only the
  order of float32 sums differs), <= 1e-4 in bf16 (the same bf16 GEMMs on the same inputs: FSDP's bf16 all-gather is
  autocast's cast; 10x UPDATE_TOL for a kernel chosen by memory layout), and the loss and grad norm within 1e-5 /
  1e-4 relative; the bf16 check is only meaningful if bf16 compute is far from fp32 compute on the same step, so that
  distance is an entry too: it must be >= 10x the bf16 tolerance.

    python scripts/gpu_check_numerics.py --device cuda|cpu --out JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
U32 = 2.0 ** -24
U_BF16 = 2.0 ** -8  # bf16's unit roundoff (8 significand bits: one rounding errs by at most 2^-8 relative)

TOLERANCES = {
    "loss": {"float32": 2e-5,
             "bfloat16": "|ref(bf16 inputs) - ref(exact)| + 2e-5 S, and |ref(bf16 inputs) - ref(exact)| <= the "
                         "a-priori bound B of bf16_loss_bound",
             "rule": "|loss - ref| <= tol * sum|per-token loss| / N (float32: the grid inputs are exact; bf16: "
                     "log-probs computed in bf16, ref on the exact log-probs)"},
    "grad": {"float32": 1e-5, "bfloat16": 1e-5 + U_BF16,
             "rule": "max_i |g_i - ref_i| / max(|ref_i|, 1e-6 max|ref|) <= tol (bf16: the gradient is returned in "
                     "bf16, one rounding, at most 2^-8 relative, more)"},
    "decision": {"float32": 0, "bfloat16": 0,
                 "rule": "masked / clipped / dropped counts equal the reference's (exact log-ratios on a grid)"},
    "logprob_vs_plain": {"float32": "log-probs 4 eps_t, grads 2 (4 sqrt(K') u S + moved(eps_t)), "
                                    "eps_t = 4 sqrt(K) u S_t",
                         "bfloat16": "log-probs 2^-7 |logit|max / T, grads 2^-7 S + moved(2^-7 |logit|max_t / T)"},
    "logprob_vs_fp64": {"float32": "log-probs 2 eps_t, grad weight 4 sqrt(N) u S + moved(eps_t)",
                        "bfloat16": "log-probs 2 eps_t (eps_t = 1.5 x 2^-7 S_t), grad weight 2^-6 S + moved(eps_t)"},
    "fsdp_update": {"float32": 1e-5, "bfloat16": 1e-4,
                    "rule": "||update_fsdp - update_torch|| / ||update_torch|| (SGD: relative gradient difference)"},
    "fsdp_scalars": {"float32": 1e-5, "bfloat16": 1e-4, "rule": "loss and grad norm, relative"},
    "bf16_discriminates": {"bfloat16": 10.0,
                           "rule": "||update_bf16 - update_fp32|| / ||update_fp32|| >= 10 x the bf16 tolerance"},
}

SIZES = {"cuda": dict(tokens=2048, hidden=576, vocab=49_152, small_chunk=300),
         "cpu": dict(tokens=48, hidden=64, vocab=4_096, small_chunk=20)}


def entry(check: str, dtype: str, quantity: str, error: float, tolerance: float, rule: str, *,
          at_most: bool = True, **extra: Any) -> dict[str, Any]:
    """One comparison: passed when ``error <= tolerance`` (``at_most=False``: ``error >= tolerance``)."""
    error = float(error)
    ok = math.isfinite(error) and (error <= tolerance if at_most else error >= tolerance)
    return {"check": check, "dtype": dtype, "quantity": quantity, "error": error, "tolerance": float(tolerance),
            "comparison": "<=" if at_most else ">=", "rule": rule, "passed": bool(ok), **extra}


# ------------------------------------------------------------------------------------------------ 1. losses
def fixed_batch():
    """16 rows x 64 tokens on float32-exact grids; NaN on padding; row-constant advantages (as GRPO's)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    rows, width = 16, 64
    lengths = torch.randint(8, width + 1, (rows,), generator=g)
    lengths[0] = width
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    lp = -torch.round((0.01 + 5.0 * torch.rand(rows, width, generator=g)) * 2**10) / 2**10
    d = torch.round((0.25 * torch.randn(rows, width, generator=g)).clamp(-1.5, 1.5) * 2**12) / 2**12
    # large log-ratios: row 3 has two above ln 10 with A < 0 (FIPO drops it), row 5 one (kept, dual-clipped)
    d[3, 5], d[3, 9], d[5, 2], d[7, 1], d[8, 4] = 2.5, 2.75, 2.625, -2.0, 3.0
    old = lp - d  # exact: both on the 2^-12 grid, below 16 in magnitude
    adv = torch.round(torch.randn(rows, 1, generator=g) * 2**8) / 2**8
    adv[adv == 0] = 0.5
    adv[3], adv[5] = -1.0, -0.75
    adv = adv.expand(rows, width).clone()
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    return lp, old, adv, mask


def _refs_module(name: str):
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _clamp(x: float, bound: float = 20.0) -> float:
    return max(-bound, min(bound, x))


def reference_m2po(lp, old, adv, mask, tau: float) -> dict[str, Any]:
    """Algorithm 1's literal loop (tests/unit/m2po_reference.py) in Python floats; gradient -A r keep / N."""
    ref = _refs_module("m2po_reference")
    rows, width = mask.shape
    valid = mask.tolist()
    d = [[(float(lp[r, c]) - float(old[r, c])) if valid[r][c] else 0.0 for c in range(width)] for r in range(rows)]
    a = adv.tolist()
    sel = ref.reference_m2po(d, a, valid, tau)
    keep = sel["keep"]
    flat = lambda m: [x for row in m for x in row]  # noqa: E731
    lpf = [float(x) if v else 0.0 for x, v in zip(flat(lp.double().tolist()), flat(valid))]
    oldf = [float(x) if v else 0.0 for x, v in zip(flat(old.double().tolist()), flat(valid))]
    loss = ref.reference_loss(lpf, oldf, flat(a), flat(keep), flat(valid))
    n = max(1, sum(flat(valid)))
    grad, terms = [], []
    for r in range(rows):
        grow = []
        for c in range(width):
            if valid[r][c] and keep[r][c]:
                ratio = math.exp(_clamp(d[r][c]))
                grow.append(-a[r][c] * ratio / n if abs(d[r][c]) <= 20 else 0.0)
                terms.append(abs(a[r][c] * ratio))
            else:
                grow.append(0.0)
        grad.append(grow)
    return {"loss": loss, "grad": grad, "scale": math.fsum(terms) / n, "decision": sel["num_masked"],
            "decision_name": "masked tokens", "keep": keep}


def reference_vanilla(lp, old, adv, mask, eps: float = 0.2) -> dict[str, Any]:
    """PPO clip, per token in Python floats: max(-A r, -A clip(r, 1 - eps, 1 + eps)), token mean."""
    rows, width = mask.shape
    valid, a = mask.tolist(), adv.tolist()
    n = max(1, sum(sum(row) for row in valid))
    total, terms, clipped, grad = [], [], 0, []
    for r in range(rows):
        grow = []
        for c in range(width):
            if not valid[r][c]:
                grow.append(0.0)
                continue
            ratio = math.exp(_clamp(float(lp[r, c]) - float(old[r, c])))
            unclipped = -a[r][c] * ratio
            clip = -a[r][c] * min(max(ratio, 1 - eps), 1 + eps)
            total.append(max(unclipped, clip))
            terms.append(abs(max(unclipped, clip)))
            is_clipped = clip > unclipped
            clipped += is_clipped
            grow.append(0.0 if is_clipped else -a[r][c] * ratio / n)
        grad.append(grow)
    return {"loss": math.fsum(total) / n, "grad": grad, "scale": math.fsum(terms) / n, "decision": clipped,
            "decision_name": "clipped tokens"}


def reference_fipo(lp, old, adv, mask) -> dict[str, Any]:
    """tests/unit/fipo_reference.py's loop (its defaults = the registry's with config {}); the gradient of its loss
    in closed form: -A w r / count on kept rows' tokens where the unclipped branch is taken, 0 where clipped."""
    import torch

    ref = _refs_module("fipo_reference")
    loss, weights, kept, _ = ref.fipo_loop(old.nan_to_num(0.0), lp.nan_to_num(0.0), adv, mask)
    rows, width = mask.shape
    valid = mask.tolist()
    count = max(1, sum(sum(valid[r]) for r in range(rows) if kept[r]))
    gamma = 2.0 ** (-1.0 / 32.0)
    log_c = float(torch.tensor(math.log(10.0), dtype=torch.float32))
    grad, terms, scan_scale = [], [], 0.0
    for r in range(rows):
        d = [_clamp(float(lp[r, c]) - float(old[r, c])) if valid[r][c] else 0.0 for c in range(width)]
        for t in range(width):  # the magnitude the future-KL scan sums, for its float32 rounding bound
            scan_scale = max(scan_scale, math.fsum(gamma ** (k - t) * abs(d[k]) for k in range(t, width)
                                                   if valid[r][k] and d[k] <= log_c))
        grow = []
        for c in range(width):
            if not (valid[r][c] and kept[r]):
                grow.append(0.0)
                continue
            ratio = math.exp(d[c])
            ah = float(adv[r, c]) * weights[r][c]
            unclipped, clip = -ah * ratio, -ah * min(max(ratio, 0.8), 1.2)
            lc = max(unclipped, clip)
            dual = ah < 0 and -ah * 10.0 < lc
            terms.append(abs(min(lc, -ah * 10.0) if ah < 0 else lc))
            grow.append(0.0 if (clip > unclipped or dual) else -ah * ratio / count)
        grad.append(grow)
    return {"loss": loss, "grad": grad, "scale": math.fsum(terms) / count, "decision": kept.count(False),
            "decision_name": "dropped rows", "scan_scale": scan_scale, "kept_rows": kept}


def bf16_rounding_violations(got, ref, rel_tol: float) -> tuple[int, int]:
    """(elements of the bf16 tensor ``got`` that are none of bf16(ref (1 - t)), bf16(ref), bf16(ref (1 + t)),
    elements equal to bf16(ref)); ``ref`` float64. A float32 result within ``t`` relative of ``ref``, rounded once to
    bf16, is one of those three (the outer two differ from the middle only where the interval straddles a bf16
    rounding boundary); NaN never matches."""
    import torch

    g = got.double()
    cands = [(ref * f).to(torch.bfloat16).double() for f in (1.0 - rel_tol, 1.0, 1.0 + rel_tol)]
    ok = (g == cands[0]) | (g == cands[1]) | (g == cands[2])
    return int((~ok).sum()), int((g == cands[1]).sum())


# ------------------------------------------------------------------------------------------------ 1b. bf16 inputs
BF16_VOCAB = 4  # the logits each bf16 log-prob is computed from (the token's and three others)
LN_C = math.log(10.0)  # FIPO's c and safety thresholds (its defaults: config {})


def bf16_batch():
    """The bf16 entries' batch: 16 rows x 64 tokens (fixed_batch's lengths and advantages), float64 log-probs
    chosen so that few decisions are within reach of bf16 rounding: old log-probs in [-1.25, -0.625] (small, so
    one bf16 rounding errs little), log-ratios from a set at least 0.089 from 0 (M2PO's trust region), ln 1.2 and
    ln 0.8 (PPO's clip) and ln 10 (FIPO's drop), so only M2PO's count (a running mean against tau) has slack; rows
    3 and 5 as in fixed_batch (FIPO drops row 3, row 5 is dual-clipped)."""
    import torch

    _, _, adv, mask = fixed_batch()
    g = torch.Generator().manual_seed(4321)
    rows, width = mask.shape
    old = -(0.625 + torch.randint(0, 41, (rows, width), generator=g).double() * 2 ** -6)
    choices = torch.tensor([-0.5, -0.375, -0.125, 0.09375, 0.3125, 0.5], dtype=torch.float64)
    d = choices[torch.randint(0, len(choices), (rows, width), generator=g)]
    d[3, 5], d[3, 9], d[5, 2] = 2.5, 2.75, 2.625
    old[3, 5], old[3, 9], old[5, 2] = -2.75, -3.0, -2.875
    lp = old + d
    nan = torch.full_like(lp, float("nan"))
    return torch.where(mask, lp, nan), torch.where(mask, old, nan), adv, mask


def bf16_logprobs(lp64, device: str):
    """Log-probs computed in bf16 on the device: each token's BF16_VOCAB logits, built in float64 so that their
    exact log-softmax is ``lp64`` (the token's logit lp, the others log((1 - e^lp) / (V - 1)), log-sum-exp 0), are
    rounded to bf16 and go through torch.log_softmax in bf16 (a bf16 result). Returns (bf16 log-probs, float64 bound
    on |bf16 - lp64| per token). The bound, for a bf16 log-softmax of bf16-rounded logits z (u = 2^-8, bf16's unit
    roundoff; u32 = 2^-24): the token's logit moves by at most u |z_id|; the log-sum-exp, whose gradient is the
    softmax, by at most e^(2m) sum_v p_v u |z_v| (m = max_v u |z_v|: the softmax at any point between z and its
    rounding is within e^(2m) of p); the float32 log-softmax inside errs by at most 8 u32 (1 + max |z|); the result
    is rounded once to bf16, u (|lp| + the above)."""
    import torch

    x = torch.nan_to_num(lp64, nan=-1.0)
    other = torch.log((1 - torch.exp(x)) / (BF16_VOCAB - 1))
    z = torch.stack([x] + [other] * (BF16_VOCAB - 1), dim=-1)  # the token is index 0
    got = torch.log_softmax(z.to(torch.bfloat16).to(device), dim=-1)[..., 0].cpu()
    p = torch.softmax(z, dim=-1)
    m = (U_BF16 * z.abs()).amax(dim=-1)
    inner = (U_BF16 * z[..., 0].abs() + torch.exp(2 * m) * (p * U_BF16 * z.abs()).sum(dim=-1)
             + 8 * U32 * (1 + z.abs().amax(dim=-1)))
    bound = inner + U_BF16 * (x.abs() + inner)
    return torch.where(torch.isnan(lp64), torch.full_like(got, float("nan")), got), bound


def _first_at_most(sq_desc, tau: float) -> int:
    """M2PO's masked count over a trust region whose squares are ``sq_desc`` (sorted down): the fewest largest ones
    to drop until the mean of the rest is <= tau."""
    for j in range(len(sq_desc)):
        if float(sq_desc[j:].mean()) <= tau:
            return j
    return len(sq_desc)


def bf16_decision_slack(name: str, d64, adv, mask, delta, ref: dict[str, Any], config: dict[str, float]) -> int:
    """How far bf16 rounding could move a decision count from the exact one, each log-ratio d_t moving by at most
    ``delta_t``. PPO's clipped tokens: one per token within delta of ln(1 +- eps). FIPO's dropped rows: one per row
    with a token within delta of ln 10 (its drop, dual clip and future-KL cut). M2PO's masked tokens: one per token
    within delta of 0 (the trust region's sign), plus the spread of the count over the intervals: with the trust
    region's squares bounded by lo = (|d| - delta)^2 and hi = (|d| + delta)^2, the count lies between its value on
    the sorted lo and on the sorted hi (the mean of what is left is monotone in every square)."""
    valid = mask.bool()
    d, dl, a = d64[valid], delta[valid], adv[valid]
    if name == "vanilla":
        eps = config["clip_ratio"]
        return int((((d - math.log(1 + eps)).abs() <= dl) | ((d - math.log(1 - eps)).abs() <= dl)).sum())
    if name == "fipo":
        near = ((d64 - LN_C).abs() <= delta) & valid
        return int(near.any(dim=1).sum())
    trust = ((a > 0) & (d > 0)) | ((a < 0) & (d < 0))
    lo = ((d.abs() - dl).clamp(min=0) ** 2)[trust].sort(descending=True).values * (1 - 2 ** -22)
    hi = ((d.abs() + dl) ** 2)[trust].sort(descending=True).values * (1 + 2 ** -22)  # + the float32 square
    k, tau = int(ref["decision"]), config["m2_threshold"]
    spread = max(k - _first_at_most(lo, tau), _first_at_most(hi, tau) - k, 0)
    return int((d.abs() <= dl).sum()) + spread


def bf16_loss_bound(name: str, d64, adv, mask, delta, ref: dict[str, Any], config: dict[str, float],
                    slack: int) -> float:
    """A bound on |loss(bf16 log-probs) - loss(exact)| from the log-ratios' rounding bounds delta_t, both computed
    exactly: every kept token's term is -A w r clipped (PPO, FIPO) with w its FIPO influence weight (in [1, 1.2]; 1
    otherwise), whose log moves by at most D_t = delta_t (FIPO: + min(sum_k>=t gamma^(k-t) delta_k, ln 1.25), its
    future KL, through a weight clipped to a range no wider than ln 1.25); the
    clips are 1-Lipschitz in the ratio, so the term moves by at most |A| w_hi max(r, 1 + eps) e^D (e^D - 1); summed
    over the N kept tokens, / N. PPO's clip is continuous (its slack costs nothing); each M2PO token whose mask
    rounding could flip (``slack``) adds at most max_t |A_t| r_t e^delta_t / N; a FIPO drop within reach makes the
    bound infinite (the batch keeps them out of reach)."""
    import torch

    if name == "fipo" and slack:
        return math.inf
    valid = mask.bool()
    r = torch.exp(torch.nan_to_num(d64, nan=0.0).clamp(-20, 20))
    dl = torch.where(valid, delta, torch.zeros_like(delta))
    w_hi, keep = 1.0, valid.clone()
    if name == "m2po":
        keep &= torch.tensor(ref["keep"], dtype=torch.bool)
    if name == "fipo":
        w_hi = 1.2
        keep &= torch.tensor(ref["kept_rows"], dtype=torch.bool).unsqueeze(1)
        gamma = 2.0 ** (-1.0 / 32.0)
        future = torch.zeros_like(dl)
        acc = torch.zeros(dl.shape[0], dtype=dl.dtype)
        for t in range(dl.shape[1] - 1, -1, -1):  # sum_k>=t gamma^(k-t) delta_k, right to left
            acc = dl[:, t] + gamma * acc
            future[:, t] = acc
        # the weight is clipped to [1, 1.2] (or [0.8, 1] on a dual-clipped token): its log moves by at most ln 1.25
        dl = dl + future.clamp(max=math.log(1.25))
    eps = config.get("clip_ratio", 0.2)
    terms = adv.abs() * w_hi * torch.maximum(r, torch.full_like(r, 1 + eps)) * torch.exp(dl) * torch.expm1(dl)
    n = max(1, int(keep.sum()))
    flips = 0.0
    if name == "m2po" and slack:
        flips = slack * float(torch.where(valid, adv.abs() * r * torch.exp(dl), torch.zeros_like(r)).max())
    return (float(torch.where(keep, terms, torch.zeros_like(terms)).sum()) + flips) / n


def _decision_from_metrics(name: str, metrics: dict[str, float], mask) -> float:
    n_valid = float(mask.sum())
    if name == "m2po":
        return metrics["m2po/num_masked_tokens"]
    if name == "vanilla":
        return round(metrics["vanilla/clip_fraction"] * n_valid)
    return round(metrics["fipo/sequence_drop_ratio"] * mask.shape[0])


def loss_checks(device: str) -> list[dict[str, Any]]:
    import torch

    from recipe.registry import get_policy_loss_fn

    config = {"m2_threshold": 0.04, "clip_ratio": 0.2}
    out = []
    for dtype in ("float32", "bfloat16"):
        if dtype == "float32":  # the device gets the grid values themselves; the reference takes the same values
            lp32, old32, adv, mask = fixed_batch()
            lp_in, old_in = lp32, old32
            exact_refs = None
        else:  # log-probs computed in bf16 (bf16 tensors into the loss); loss and decisions against the exact ones
            lp64, old64, adv, mask = bf16_batch()
            (lp_in, e_lp), (old_in, e_old) = bf16_logprobs(lp64, device), bf16_logprobs(old64, device)
            delta = e_lp + e_old  # the bound on each log-ratio's bf16 error
            exact_refs = _references(lp64, old64, adv, mask, config)
        refs = _references(lp_in.double(), old_in.double(), adv, mask, config)
        for name, ref in refs.items():
            fn = get_policy_loss_fn(name)
            lp_dev = lp_in.detach().clone().to(device).requires_grad_()
            loss, metrics = fn(old_log_prob=old_in.to(device), log_prob=lp_dev, advantages=adv.to(device),
                               response_mask=mask.to(device), loss_agg_mode="token-mean",
                               config={} if name == "fipo" else config)
            loss.backward()
            got_grad = torch.nan_to_num(lp_dev.grad.detach().double().cpu(), nan=math.inf)
            ref_grad = torch.tensor(ref["grad"], dtype=torch.float64)
            floor = 1e-6 * float(ref_grad.abs().max())
            grad_rel = float(((got_grad - ref_grad).abs() / ref_grad.abs().clamp(min=floor)).max())
            grad_err = grad_rel
            loss_err = abs(float(loss.detach().double().cpu()) - ref["loss"]) / max(ref["scale"], 1e-30)
            grad_tol = TOLERANCES["grad"][dtype]
            grad_rule = TOLERANCES["grad"]["rule"]
            if name == "fipo":  # the influence weight's float32 scan over up to T tokens
                scan = 2 * mask.shape[1] * U32 * ref["scan_scale"]
                grad_tol = max(grad_tol, scan + (U_BF16 if dtype == "bfloat16" else 0.0))
                grad_rule += (f"; FIPO: max(1e-5, 2 T u max_t sum_k gamma^(k-t) |d_k|) = {scan:.3g} for T = "
                              f"{mask.shape[1]} (float32 rounding of the future-KL scan in exp(future KL))")
            what = f"{name} on the device vs the CPU float64 reference"
            if exact_refs is None:
                out.append(entry(f"loss/{name}", dtype, "loss", loss_err, TOLERANCES["loss"][dtype],
                                 TOLERANCES["loss"]["rule"], value=float(loss.detach()), reference=ref["loss"],
                                 what=what))
            else:
                out += _bf16_loss_entries(name, loss, metrics, lp64 - old64, adv, mask, delta, exact_refs[name],
                                          ref, config, lp_in, e_lp, lp64)
            if dtype == "bfloat16":  # exact: the float64 reference rounded to bf16, as the device's gradient is
                t32 = grad_tol - U_BF16  # the float32 gradient's tolerance (before its one rounding to bf16)
                grad_err, exact = bf16_rounding_violations(lp_dev.grad.detach().cpu(), ref_grad, t32)
                grad_tol = 0
                grad_rule = (f"elements of the bf16 gradient not equal to the float64 reference rounded to bf16 "
                             f"(the device widens, computes in float32 within {t32:.3g} relative, and rounds once): "
                             f"either bf16 neighbour is accepted only where ref x (1 -/+ {t32:.3g}) straddles a "
                             f"rounding boundary")
                extra = {"exactly_rounded": exact, "max_rel_vs_float64": grad_rel}
            else:
                extra = {}
            out.append(entry(f"loss/{name}", dtype, "grad log_prob", grad_err, grad_tol, grad_rule, what=what,
                             grad_max_abs=float(ref_grad.abs().max()), **extra))
            if exact_refs is None:
                got = _decision_from_metrics(name, metrics, mask)
                out.append(entry(f"loss/{name}", dtype, ref["decision_name"], abs(got - ref["decision"]), 0,
                                 TOLERANCES["decision"]["rule"], value=got, reference=ref["decision"], what=what))
    return out


def _references(lp, old, adv, mask, config) -> dict[str, dict[str, Any]]:
    return {"m2po": reference_m2po(lp, old, adv, mask, config["m2_threshold"]),
            "vanilla": reference_vanilla(lp, old, adv, mask, config["clip_ratio"]),
            "fipo": reference_fipo(lp, old, adv, mask)}


def _bf16_loss_entries(name, loss, metrics, d64, adv, mask, delta, exact, ref_in, config, lp_in, e_lp,
                       lp64) -> list:
    """The bf16 entries of one loss fed log-probs computed in bf16, against the float64 reference on the exact
    log-probs (``exact``) and on the bf16 inputs (``ref_in``):

    - the log-probs within their rounding bound e_t (bf16_logprobs);
    - the decision count equal to ``ref_in``'s (the implementation on these inputs: exact), and within
      bf16_decision_slack of the exact one;
    - the loss within |ref_in - exact| + 2e-5 S of the exact one (what the bf16 inputs move it, computed in float64,
      plus the float32 arithmetic on widened inputs: a loss that rounds to bf16 inside errs by ~2^-9 S, far above);
    - |ref_in - exact| within bf16_loss_bound (the rounding analysis' a-priori bound holds)."""
    what = f"{name} fed log-probs computed in bf16, vs the CPU float64 reference on the exact log-probs"
    valid = mask.bool()
    lp_err = float(((lp_in.double() - lp64).abs() / e_lp)[valid].max())
    slack = bf16_decision_slack(name, d64, adv, mask, delta, exact, config)
    bound = bf16_loss_bound(name, d64, adv, mask, delta, exact, config, slack)
    scale = max(exact["scale"], 1e-30)
    effect = abs(ref_in["loss"] - exact["loss"])
    got_loss = float(loss.detach().double().cpu())
    got = _decision_from_metrics(name, metrics, mask)
    dname = exact["decision_name"]
    return [
        entry(f"loss/{name}", "bfloat16", "bf16 log-probs vs exact", lp_err, 1.0,
              "max_t |lp_bf16 - lp| / e_t <= 1, e_t = u |z_id| + e^(2m) sum_v p_v u |z_v| + 8 u32 (1 + max|z|) "
              "+ u (|lp| + that) for a bf16 log-softmax of bf16-rounded logits (u = 2^-8)", what=what),
        entry(f"loss/{name}", "bfloat16", dname, abs(got - ref_in["decision"]), 0,
              TOLERANCES["decision"]["rule"] + " (the reference on the bf16 inputs: the same decisions, exact)",
              value=got, reference=ref_in["decision"], what=what),
        entry(f"loss/{name}", "bfloat16", f"{dname} vs exact", abs(got - exact["decision"]), slack,
              "|count - exact count| <= what bf16 rounding could move (bf16_decision_slack: tokens within delta_t = "
              "e(lp_t) + e(old_t) of a threshold; M2PO: the count's spread over the squares' intervals)",
              value=got, reference=exact["decision"], what=what),
        entry(f"loss/{name}", "bfloat16", "loss", abs(got_loss - exact["loss"]) / scale,
              (effect + TOLERANCES["loss"]["float32"] * scale) / scale,
              "|loss - ref| / S <= (|ref_bf16_inputs - ref| + 2e-5 S) / S: the bf16 inputs' effect in float64 plus "
              "the float32 tolerance (S = sum|per-token loss| / N)", value=got_loss, reference=exact["loss"],
              rounding_effect=effect, what=what),
        entry(f"loss/{name}", "bfloat16", "rounding effect vs its a-priori bound", effect / scale, bound / scale,
              "|ref_bf16_inputs - ref| / S <= B / S, B = (1/N) sum_kept |A_t| w_hi max(r_t, 1 + eps) e^D_t (e^D_t "
              "- 1) (+ M2PO's flippable tokens), D_t = delta_t (FIPO: + min(sum_k>=t gamma^(k-t) delta_k, ln 1.25); "
              "w_hi 1.2)",
              bf16_bound=bound, what=what)]


# ------------------------------------------------------------------------------------------------ 2. log-probs
def logprob_checks(device: str) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from stalerl.core.chunked_logprob import chunked_token_logprobs, default_chunk_tokens

    size = SIZES[device]
    dev = torch.device(device)
    n, k, v, temp = size["tokens"], size["hidden"], size["vocab"], 0.7
    g = torch.Generator().manual_seed(7)
    h0 = torch.randn(n, k, generator=g)
    w0 = torch.randn(v, k, generator=g) * 0.05
    ids = torch.randint(0, v, (n,), generator=g)
    go = torch.randn(n, generator=g)  # the upstream gradient of the log-probs
    h0, w0, ids, go = h0.to(dev), w0.to(dev), ids.to(dev), go.to(dev)

    def plain(h, w):  # the literal computation: whole logits, float32 (float64 for the reference) log-softmax
        x = F.linear(h, w)
        x = x if x.dtype == torch.float64 else x.float()
        return torch.log_softmax(x / temp, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def run(fn, dtype: str, h_in=None, w_in=None):
        h = (h0 if h_in is None else h_in).clone().requires_grad_()
        w = (w0 if w_in is None else w_in).clone().requires_grad_()
        ctx = (torch.autocast(dev.type, dtype=torch.bfloat16) if dtype == "bfloat16"
               else torch.autocast(dev.type, enabled=False))
        with ctx:
            lp = fn(h, w)
        (lp * go.to(lp.dtype)).sum().backward()
        return lp.detach().double(), h.grad.double(), w.grad.double()

    ref = run(plain, "float32", h0.double(), w0.double())  # float64 on the device
    # Error scales, in float64: S of each token's logits (sum of |h_k w_vk|, max over the vocabulary, / T), of each
    # gradient element (|dL/dlogits| @ |W|, |dL/dlogits|^T @ |h|), and how a per-token logit error eps_t moves the
    # gradient of the logits: |d(dL/dlogit_tv)| <= |go_t| / T * p_tv * 2 eps_t (the logit and the log-sum-exp).
    hd, wd = h0.double(), w0.double()
    logits = F.linear(hd, wd) / temp
    s_lp = (hd.abs() @ wd.abs().t()).amax(dim=1) / temp
    l_max = logits.abs().amax(dim=1)
    probs = torch.softmax(logits, dim=-1)
    gx = -probs * (go.double() / temp).unsqueeze(1)
    gx[torch.arange(n, device=dev), ids] += go.double() / temp
    s_gh, s_gw = gx.abs() @ wd.abs(), gx.abs().t() @ hd.abs()
    spread = probs * (2 * go.double().abs() / temp).unsqueeze(1)
    spread_w = spread @ wd.abs()
    del logits, gx

    def moved(eps):  # bounds on the gradients (hidden, weight) from per-token logit errors eps (N,)
        return eps.unsqueeze(1) * spread_w, spread.t() @ (eps.unsqueeze(1) * hd.abs())

    lam = 4.0  # the probabilistic bound lambda sqrt(K) u S of a K-term float32 sum (Higham & Mary, 2019)
    eps32 = lam * math.sqrt(k) * U32 * s_lp  # one float32 logit against the exact one
    m32 = moved(eps32)
    eps16 = 2 * U_BF16 * l_max  # one bf16 ulp of the logit: two bf16 roundings of nearly the same float32 value
    m16 = moved(eps16)
    eps16_exact = 1.5 * 2 * U_BF16 * s_lp  # bf16-rounded h and W (2^-8 each) and the rounded logit (2^-8 |logit|)
    m16_exact = moved(eps16_exact)
    acc = {name: lam * math.sqrt(terms) * U32 for name, terms in (("h", v), ("w", n))}
    lp16_bound = bf16_chunked_vs_plain_logprob_bound(h0, w0, ids, temp, lam)
    vs_plain = {  # chunked against plain: both sides' errors
        "float32": ([4 * eps32, 2 * (acc["h"] * s_gh + m32[0]),
                     2 * (acc["w"] * s_gw + m32[1])],
                    "log-probs 4 eps_t; grads 2 (4 sqrt(K') u S + moved(eps_t)), eps_t = 4 sqrt(K) u S_t (one "
                    "float32 logit), K' the gradient's sum length"),
        "bfloat16": ([lp16_bound, 2 * U_BF16 * s_gh + m16[0], 2 * U_BF16 * s_gw + m16[1]],
                     "log-probs: per token (ulp_id f_id + 1.25 sum_v p_v ulp_v f_v) / T + 2 ((4 sqrt(V) + 2) u + 2 u "
                     "(|lse| + |logp|)), f_v = 1 where the bf16 inputs' exact logit lies within 4 sqrt(K) u S_v of a "
                     "bf16 rounding boundary (only there can two float32 accumulations round to different bf16 "
                     "logits, one ulp apart), plus the float32 log-softmax of each side; grads 2^-7 S + moved(2^-7 "
                     "|logit|max_t / T) (one bf16 rounding of a partial sum on either side; one bf16 ulp of a logit)")}
    vs_fp64 = {
        "float32": ([2 * eps32, acc["w"] * s_gw + m32[1]],
                    "log-probs 2 eps_t (the logit and the log-sum-exp), grad weight 4 sqrt(N) u S + moved(eps_t)"),
        "bfloat16": ([2 * eps16_exact, 2 * 2 * U_BF16 * s_gw + m16_exact[1]],
                     "log-probs 2 eps_t with eps_t = 1.5 x 2^-7 S_t (bf16-rounded inputs and logit), grad weight "
                     "2^-6 S (the unit test's 4 U_BF16) + moved(eps_t)")}
    device_chunk = default_chunk_tokens(dev, v)
    out = []
    for dtype in ("float32", "bfloat16"):
        p = run(plain, dtype)
        small = None
        for label, chunk in ((f"device chunk {device_chunk}", None), (f"chunk {size['small_chunk']}",
                                                                     size["small_chunk"])):
            c = run(lambda h, w: chunked_token_logprobs(h, w, ids, temp, chunk), dtype)
            small = c
            bounds, rule = vs_plain[dtype]
            for quantity, a, b, bound in zip(("log-probs", "grad hidden", "grad weight"), c, p, bounds):
                ratio = float(((a - b).abs() / (bound + 1e-7)).max())
                out.append(entry(f"logprob/chunked_vs_plain ({label})", dtype, quantity, ratio, 1.0,
                                 f"max_i |chunked_i - plain_i| / (bound_i + 1e-7) <= 1; bound: {rule}",
                                 max_abs_diff=float((a - b).abs().max()), tokens=n, hidden=k, vocab=v))
        for name, got in (("chunked", small), ("plain", p)):
            bounds, rule = vs_fp64[dtype]
            for quantity, a, b, bound in zip(("log-probs", "grad weight"), (got[0], got[2]), (ref[0], ref[2]),
                                             bounds):
                ratio = float(((a - b).abs() / (bound + 1e-7)).max())
                out.append(entry(f"logprob/{name}_vs_float64", dtype, quantity, ratio, 1.0,
                                 f"max_i |x_i - float64_i| / (bound_i + 1e-7) <= 1; bound: {rule}",
                                 max_abs_diff=float((a - b).abs().max())))
    return out


def bf16_chunked_vs_plain_logprob_bound(h0, w0, ids, temp: float, lam: float = 4.0, rows: int = 256):
    """Per token, a bound on |chunked - plain| for bf16-autocast log-probs, from the rounding analysis: both sides
    multiply the same bf16-rounded h and W (exact products) and accumulate in float32, each within
    ``eps_v = lam sqrt(K) u S_v`` of the exact sum x_v, then round to bf16. Their bf16 logits can differ only where
    [x_v - eps_v, x_v + eps_v] holds a rounding boundary (a midpoint between bf16 neighbours), and then by one ulp.
    A logit difference delta_v moves the log-prob by delta_id / T - sum_v p_v delta_v / T (the log-sum-exp), taken
    with p from the exact logits and 1.25 for the rounded ones' p; each side's float32 log-softmax adds at most
    (lam sqrt(V) + 2) u + 2 u (|lse| + |logp|). Computed in float64 on the device, ``rows`` tokens at a time."""
    import torch

    hb, wb = h0.to(torch.bfloat16).double(), w0.to(torch.bfloat16).double()
    n, k = hb.shape
    v = wb.shape[0]
    out = torch.empty(n, dtype=torch.float64, device=hb.device)
    for a in range(0, n, rows):
        h = hb[a:a + rows]
        x = h @ wb.t()  # the exact logits of the bf16 inputs
        eps = lam * math.sqrt(k) * U32 * (h.abs() @ wb.abs().t())
        mag = x.abs().clamp(min=2.0 ** -126)
        ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)  # bf16 spacing in x's binade (8 significand bits)
        frac = x.abs() / ulp
        dist = (frac - torch.floor(frac) - 0.5).abs() * ulp  # to the nearest rounding boundary
        delta = torch.where(dist <= eps, ulp, torch.zeros_like(ulp))
        z = x / temp
        lse = torch.logsumexp(z, dim=1)
        p = torch.exp(z - lse.unsqueeze(1))
        idx = ids[a:a + rows].unsqueeze(1)
        d_id = delta.gather(1, idx).squeeze(1)
        logp = z.gather(1, idx).squeeze(1) - lse
        f32 = (lam * math.sqrt(v) + 2) * U32 + 2 * U32 * (lse.abs() + logp.abs())
        out[a:a + rows] = (d_id + 1.25 * (p * delta).sum(dim=1)) / temp + 2 * f32
    return out


# ------------------------------------------------------------------------------------------------ 3. fsdp:d1
def _update_distance(a: dict, b: dict, start: dict) -> float:
    num = sum(float(((a[n].double().cpu() - b[n].double().cpu()) ** 2).sum()) for n in start)
    den = sum(float(((b[n].double().cpu() - start[n].double().cpu()) ** 2).sum()) for n in start)
    return (num / max(den, 1e-300)) ** 0.5


def fsdp_checks(device: str) -> list[dict[str, Any]]:
    import copy
    import datetime
    import socket

    import torch
    import torch.distributed as dist

    from stalerl.config import NormConfig, load_config
    from stalerl.core.model import PromptFormatter, load_policy
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.training.actor import Actor, DataParallel
    from stalerl.training.advantage import grpo_advantages

    dev = torch.device(device)
    torch.manual_seed(0)
    model, tok = load_policy("tiny:qwen2", dtype="float32", device=device, seed=0)
    torch.manual_seed(5)
    behaviour = copy.deepcopy(model)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = HFRolloutEngine(behaviour, tok, PromptFormatter(tok).format, gsm8k_reward, device=dev)
    questions = ["12+7=?", "3+45=?", "99+1=?", "8+8=?", "40+2=?", "5+5=?"]
    batch = engine.generate(questions, ["19", "48", "100", "16", "42", "10"], n_samples=4, max_new_tokens=8)
    batch.rewards = (torch.rand(batch.num_rows) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    overrides = ["actor.loss=m2po", "actor.m2_threshold=0.01", "actor.optimizer.type=sgd", "actor.optimizer.lr=1e-2",
                 "actor.ppo_n_minibatches=1", "train_dataset.batch_size=6", "actor.optimizer.gradient_clipping=1.0",
                 "actor.mb_spec.max_tokens_per_mb=256", f"actor.device={device}"]

    def step(dtype: str, sharded: bool) -> tuple[dict, dict]:
        cfg = load_config([*overrides, f"actor.dtype={dtype}"]).actor
        m = copy.deepcopy(model)
        m.load_state_dict(start)
        if sharded:
            actor = Actor(m, cfg, temperature=1.0, total_updates=4,
                          dp=DataParallel(rank=0, size=1, group=dist.group.WORLD))
            actor.shard(dtype)
        else:
            actor = Actor(m, cfg, temperature=1.0, total_updates=4)
        metrics = actor.update(batch, adv)
        return {k: v.detach().clone().cpu() for k, v in actor.full_model_state().items()}, metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    out = []
    try:
        plain = {}
        for dtype in ("float32", "bfloat16"):
            w_torch, m_torch = step(dtype, sharded=False)
            w_fsdp, m_fsdp = step(dtype, sharded=True)
            plain[dtype] = w_torch
            moved = _update_distance(w_torch, {k: v.cpu() for k, v in start.items()}, start)
            what = f"one SGD step, fsdp:d1 (FSDP2 over 1 rank, {backend}) vs torch:d1, tiny Qwen2, M2PO batch"
            out.append(entry("fsdp_d1_vs_torch_d1", dtype, "relative update difference",
                             _update_distance(w_fsdp, w_torch, start), TOLERANCES["fsdp_update"][dtype],
                             TOLERANCES["fsdp_update"]["rule"], what=what, update_norm_ratio=moved))
            for key in ("actor/loss", "actor/grad_norm"):
                a, b = m_fsdp[key], m_torch[key]
                out.append(entry("fsdp_d1_vs_torch_d1", dtype, key, abs(a - b) / max(abs(b), 1e-30),
                                 TOLERANCES["fsdp_scalars"][dtype], TOLERANCES["fsdp_scalars"]["rule"], value=a,
                                 reference=b, what=what))
        distance = _update_distance(plain["bfloat16"], plain["float32"], start)
        out.append(entry("fsdp_d1_vs_torch_d1", "bfloat16", "bf16 vs fp32 compute (the check can see bf16)",
                         distance, TOLERANCES["bf16_discriminates"]["bfloat16"] * TOLERANCES["fsdp_update"]["bfloat16"],
                         TOLERANCES["bf16_discriminates"]["rule"], at_most=False))
    finally:
        dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------------------ driver
def run_all(device: str, parts: tuple[str, ...] = ("losses", "logprobs", "fsdp")) -> dict[str, Any]:
    import torch

    # The process-wide settings below are put back at the end (the unit tests call this in their own process).
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    torch.manual_seed(0)
    if device == "cpu":
        torch.set_num_threads(1)  # tiny sizes: more threads only contend on a shared machine
    # Deterministic kernels (cuBLAS needs its workspace setting before the first GEMM): a comparison then differs
    # only by what the two computations do differently, not by run-to-run atomics.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the defaults, stated: float32 means float32 here
        torch.backends.cudnn.allow_tf32 = False
    try:
        return _run_parts(device, parts)
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])


def _run_parts(device: str, parts: tuple[str, ...]) -> dict[str, Any]:
    import torch

    funcs: dict[str, Callable[[str], list]] = {"losses": loss_checks, "logprobs": logprob_checks,
                                               "fsdp": fsdp_checks}
    result: dict[str, Any] = {"device": device, "entries": [], "errors": [], "seconds": {},
                              "tolerances": TOLERANCES}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
        result["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    for part in parts:
        start = time.perf_counter()
        try:
            result["entries"] += funcs[part](device)
        except Exception as exc:  # noqa: BLE001 - named in the report, which then fails
            result["errors"].append({"part": part, "why": f"{type(exc).__name__}: {exc}",
                                     "tail": traceback.format_exc()[-2000:]})
        result["seconds"][part] = time.perf_counter() - start
        if device == "cuda":
            torch.cuda.synchronize()
    failed = [e for e in result["entries"] if not e["passed"]]
    result["summary"] = {"checks": len(result["entries"]), "passed": len(result["entries"]) - len(failed),
                         "failed": [f"{e['check']} [{e['dtype']}] {e['quantity']}: {e['error']:.3g} "
                                    f"(tolerance {e['comparison']} {e['tolerance']:.3g})" for e in failed],
                         "errors": [f"{e['part']}: {e['why']}" for e in result["errors"]]}
    result["ok"] = not failed and not result["errors"]
    return result


def format_numerics(result: dict[str, Any]) -> list[str]:
    lines = []
    for e in result.get("entries", []):
        lines.append(f"  {'ok  ' if e['passed'] else 'FAIL'} {e['check']} [{e['dtype']}] {e['quantity']}: "
                     f"{e['error']:.3g} {e['comparison']} {e['tolerance']:.3g}")
    for e in result.get("errors", []):
        lines.append(f"  FAIL {e['part']}: {e['why']}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="losses,logprobs,fsdp")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    result = run_all(args.device, tuple(p for p in args.parts.split(",") if p))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    s = result["summary"]
    print(f"gpu_check numerics ({args.device}): {s['passed']}/{s['checks']} within tolerance"
          + (f", {len(s['errors'])} part(s) crashed" if s["errors"] else ""))
    print("\n".join(format_numerics(result)))
    print("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in result["seconds"].items()))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
