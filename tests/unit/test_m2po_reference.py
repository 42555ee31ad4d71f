"""The fast select_m2po against the literal loop of Algorithm 1 (tests/unit/m2po_reference.py).

Thousands of seeded random batches (numpy), plus hypothesis-generated ones: continuous and quantised values (ties),
mixed quadrants, zero advantages, padding holding garbage, empty batches, tau including 0 and tau equal to a
reachable mean. Also the same cases with the CPU pass cut into tiny slices, so the slice bookkeeping is exercised.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from m2po_reference import f32, reference_loss, reference_m2po  # noqa: E402

import recipe.m2po.algorithm as algo  # noqa: E402
from recipe.m2po import compute_policy_loss_m2po, select_m2po  # noqa: E402


def _random_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    rows = int(rng.integers(0, 6))
    cols = int(rng.integers(0, 14))
    shape = (rows, cols)
    kind = rng.integers(0, 4)
    if kind == 0:  # continuous, one scale
        d = rng.normal(0.0, rng.choice([0.02, 0.1, 0.3, 1.0]), shape)
    elif kind == 1:  # dyadic quantised: exact sums, many ties, exact zeros
        d = rng.integers(-8, 9, shape) / rng.choice([4.0, 16.0, 64.0])
    elif kind == 2:  # stale-like: small body, heavy tail
        d = rng.normal(0.0, 0.07, shape)
        tail = rng.random(shape) < 0.15
        d = np.where(tail, rng.uniform(0.2, 2.0, shape) * rng.choice([-1.0, 1.0], shape), d)
    else:  # decimal quantised: ties that are not exact in binary
        d = np.round(rng.normal(0.0, 0.3, shape), 1)
    d = d.astype(np.float32)

    akind = rng.integers(0, 3)
    if akind == 0:  # GRPO: constant per row, some rows zero
        a = np.repeat(rng.choice([-1.5, -1.0, -0.25, 0.0, 0.5, 1.0], (rows, 1)), cols, axis=1)
    elif akind == 1:  # per token, with zeros
        a = rng.integers(-2, 3, shape).astype(np.float64)
    else:
        a = rng.normal(0.0, 1.0, shape)
        a[rng.random(shape) < 0.2] = 0.0
    a = a.astype(np.float32)

    mkind = rng.integers(0, 4)
    if mkind == 0:
        mask = np.ones(shape, dtype=bool)
    elif mkind == 1:  # right padding
        lengths = rng.integers(0, cols + 1, rows)
        mask = np.arange(cols)[None, :] < lengths[:, None]
    elif mkind == 2:  # arbitrary holes (packed / prompt tokens)
        mask = rng.random(shape) < 0.7
    else:
        mask = rng.random(shape) < 0.15
    # garbage on padding
    garbage = rng.choice([np.nan, np.inf, -np.inf, 1e30, 5.0], shape).astype(np.float32)
    d = np.where(mask, d, garbage)
    a = np.where(mask, a, rng.choice([np.nan, 7.0, -np.inf], shape).astype(np.float32))

    tkind = rng.integers(0, 6)
    if tkind == 0:
        tau = 0.0
    elif tkind == 1:
        tau = 0.04
    elif tkind == 2:
        tau = float(rng.uniform(0.0, 0.5))
    elif tkind == 3:
        tau = float(rng.integers(0, 64)) / 256  # dyadic, can equal a mean of dyadic values
    elif tkind == 4:
        tau = float(rng.choice([1e-6, 10.0, 1e300]))
    else:
        # exactly the mean of the k smallest trust-region values, computed as both implementations compute it:
        # the stopping rule's equality case
        sq = sorted(f32(float(x) * float(x)) for x, y, m in zip(d.ravel(), a.ravel(), mask.ravel())
                    if m and ((y > 0 and x > 0) or (y < 0 and x < 0)))
        if sq:
            k = int(rng.integers(1, len(sq) + 1))
            tau = math.fsum(sq[:k]) / k
        else:
            tau = 0.04
    return d, a, mask, tau


def _check(d: np.ndarray, a: np.ndarray, mask: np.ndarray, tau: float, where: str) -> None:
    expected = reference_m2po(d.tolist(), a.tolist(), mask.tolist(), tau)
    sel = select_m2po(torch.from_numpy(d), torch.from_numpy(a), torch.from_numpy(mask), tau)
    ctx = f"{where}: tau={tau!r}\nd={d.tolist()}\na={a.tolist()}\nmask={mask.tolist()}"
    assert sel.keep_mask.tolist() == expected["keep"], ctx
    assert sel.trust_region.tolist() == expected["in_t"], ctx
    assert sel.num_valid == expected["num_valid"], ctx
    assert sel.num_trust_region == expected["num_trust_region"], ctx
    assert sel.num_masked == expected["num_masked"], ctx
    assert sel.m2_before == pytest.approx(expected["m2_before"], rel=1e-12, abs=1e-300), ctx
    assert sel.m2_after == pytest.approx(expected["m2_after"], rel=1e-12, abs=1e-300), ctx
    assert sel.m2_after <= tau, ctx


@pytest.mark.parametrize("block", range(8))
def test_fast_matches_literal_loop_seeded(block):
    rng = np.random.default_rng(20260822 + block)
    for i in range(500):
        _check(*_random_case(rng), where=f"block {block} case {i}")


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_fast_matches_literal_loop_with_tiny_cpu_slices(monkeypatch, chunk):
    monkeypatch.setattr(algo, "_CPU_CHUNK", chunk)
    rng = np.random.default_rng(777 + chunk)
    for i in range(250):
        _check(*_random_case(rng), where=f"chunk {chunk} case {i}")


def test_fast_matches_literal_loop_larger_batches():
    # a few stale-like batches of a few thousand tokens, several CPU slices
    rng = np.random.default_rng(99)
    for i, (rows, cols) in enumerate([(8, 256), (24, 128), (3, 1500)]):
        d = rng.normal(0.0, 0.08, (rows, cols))
        tail = rng.random((rows, cols)) < 0.04
        d = np.where(tail, rng.uniform(0.2, 2.0, (rows, cols)) * rng.choice([-1.0, 1.0], (rows, cols)), d)
        d = d.astype(np.float32)
        a = np.repeat(rng.choice([-1.0, 0.0, 1.0], (rows, 1)), cols, axis=1).astype(np.float32)
        lengths = rng.integers(cols // 4, cols + 1, rows)
        mask = np.arange(cols)[None, :] < lengths[:, None]
        d = np.where(mask, d, np.float32(np.nan))
        for tau in (0.0, 0.04, 0.1):
            _check(d, a, mask, tau, where=f"large {i}")


def test_fast_matches_literal_loop_with_slices_on_large_batches(monkeypatch):
    monkeypatch.setattr(algo, "_CPU_CHUNK", 1000)
    rng = np.random.default_rng(5)
    d = np.round(rng.normal(0.0, 0.25, (6, 700)), 2).astype(np.float32)  # many ties
    a = np.repeat(rng.choice([-1.0, 0.0, 1.0], (6, 1)), 700, axis=1).astype(np.float32)
    mask = rng.random((6, 700)) < 0.9
    for tau in (0.0, 0.01, 0.04, 0.2):
        _check(d, a, mask, tau, where="sliced large")


def test_loss_matches_reference_loss():
    rng = np.random.default_rng(3)
    for _ in range(50):
        d, a, mask, tau = _random_case(rng)
        if d.size == 0:
            continue
        old = np.where(mask, rng.normal(-1.0, 0.5, d.shape), 0.0).astype(np.float32)
        d_clean = np.where(mask, np.clip(d, -5, 5), 0.0).astype(np.float32)
        a_clean = np.where(mask, a, 0.0).astype(np.float32)
        lp = (old + d_clean).astype(np.float32)
        loss, _ = compute_policy_loss_m2po(torch.from_numpy(old), torch.from_numpy(lp), torch.from_numpy(a_clean),
                                           torch.from_numpy(mask), config={"m2_threshold": tau})
        # the reference selection on the same float32 log-ratios the loss sees
        d32 = (torch.from_numpy(lp) - torch.from_numpy(old)).tolist()
        keep = reference_m2po(d32, a_clean.tolist(), mask.tolist(), tau)["keep"]
        expected = reference_loss([x for r in lp.tolist() for x in r], [x for r in old.tolist() for x in r],
                                  a_clean.ravel().tolist(), [k for r in keep for k in r], mask.ravel().tolist())
        assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


# --- hypothesis ------------------------------------------------------------------------------------------------

_token = st.tuples(
    st.integers(-12, 12).map(lambda k: k / 8.0),  # dyadic d: ties and exact means
    st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0]),  # advantage, zeros included
    st.booleans(),  # valid
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 4).flatmap(lambda rows: st.integers(0, 8).flatmap(
        lambda cols: st.lists(_token, min_size=rows * cols, max_size=rows * cols).map(
            lambda toks: (rows, cols, toks)))),
    st.one_of(st.just(0.0), st.integers(0, 160).map(lambda k: k / 64.0), st.floats(0.0, 3.0)),
)
def test_fast_matches_literal_loop_hypothesis(batch, tau):
    rows, cols, toks = batch
    d = np.array([t[0] for t in toks], dtype=np.float32).reshape(rows, cols)
    a = np.array([t[1] for t in toks], dtype=np.float32).reshape(rows, cols)
    mask = np.array([t[2] for t in toks], dtype=bool).reshape(rows, cols)
    _check(d, a, mask, tau, where="hypothesis")


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.lists(st.floats(-3.0, 3.0, allow_nan=False, width=32), min_size=0, max_size=40),
       st.floats(0.0, 1.0))
def test_fast_matches_literal_loop_hypothesis_continuous(values, tau):
    d = np.array(values, dtype=np.float32).reshape(1, -1)
    a = np.where(np.arange(d.shape[1]) % 3 == 0, -1.0, 1.0).astype(np.float32).reshape(1, -1)
    mask = np.ones(d.shape, dtype=bool)
    _check(d, a, mask, tau, where="hypothesis continuous")


@pytest.mark.parametrize("tau", [0.1, 0.3, 0.04, 1 / 3, 0.7, 2.2, 1e-5])
def test_float32_neighbours_of_tau(tau):
    # trust-region values whose float32 square lands on, just below and just above tau (tau itself is not a float32)
    base = np.float32(np.sqrt(tau))
    d = np.array([[np.nextafter(base, np.float32(0)), base, np.nextafter(base, np.float32(9)),
                   np.float32(0.001)]], dtype=np.float32)
    a = np.ones_like(d)
    for cols in ([0], [1], [2], [1, 3], [2, 3], [0, 1, 2], [0, 1, 2, 3]):
        sub = np.ascontiguousarray(d[:, cols])
        _check(sub, np.ascontiguousarray(a[:, cols]), np.ones(sub.shape, dtype=bool), tau, where=f"cols {cols}")
