"""The radix selection (recipe/m2po/radix_select.py) against the sort it replaces, a full-sort selection and the
literal loop of Algorithm 1, on random and adversarial batches.

Three selections must choose the same mask: ``select_m2po`` as shipped (the radix select, falling back to the sort
only where it cannot prove it agrees), the same function forced onto its sort (``_sort_decision``, the previous
implementation's decision), and the literal reference (tests/unit/m2po_reference.py). Adversarial batches: many exact
ties at the boundary, all tokens in T, none, a single token, huge and tiny magnitudes (d^2 overflowing to inf,
underflowing to 0 or subnormal), float32 values one ulp apart around sqrt(tau), tau equal to a reachable mean, tau
just below a float32. Each runs both ways the pass can hand over the high tokens: compacted (the default) and as a
full-size key tensor (no host synchronisation at all: ``_FULL_SIZE_DEVICES``).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Callable

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from m2po_reference import f32, reference_m2po  # noqa: E402

import recipe.m2po.algorithm as algo  # noqa: E402
import recipe.m2po.radix_select as radix  # noqa: E402
from recipe.m2po import select_m2po  # noqa: E402

PATHS = ("compact", "full_size")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run the test with the pass compacting the high tokens or keeping a full-size key tensor."""
    monkeypatch.setattr(algo, "_FULL_SIZE_DEVICES", () if request.param == "compact" else ("cpu",))
    return request.param


class Counter:
    """Counts how often select_m2po fell back to the sort."""

    def __init__(self, monkeypatch):
        self.fallbacks = 0
        original = algo._sort_decision

        def counting(*args, **kwargs):
            self.fallbacks += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(algo, "_sort_decision", counting)


@pytest.fixture
def counter(monkeypatch):
    return Counter(monkeypatch)


_SORT_DECISION = algo._sort_decision  # before any test wraps it


def sort_selection(d: torch.Tensor, a: torch.Tensor, mask: torch.Tensor, tau: float) -> dict:
    """The previous implementation: the same pass, then the sort's decision (``_sort_decision``)."""
    valid = mask.bool()
    local = algo._local_pass(d, a, valid, radix.float32_floor(tau))
    positions, values = local.high()
    decision = _SORT_DECISION(values, local.totals[0], local.totals[1], tau, None)
    keep = valid.flatten().clone()
    keep[positions] = decision.keep_high
    stats = algo._selection_stats(decision, local.totals[0], local.totals[1], local.totals[2],
                                  torch.ones((), dtype=torch.bool)).tolist()
    return {"keep_mask": keep.view_as(valid), "trust_region": local.in_t, "num_valid": int(stats[0]),
            "num_trust_region": int(stats[1]), "num_masked": int(stats[2])}


def full_sort_keep(d: np.ndarray, a: np.ndarray, mask: np.ndarray, tau: float) -> list:
    """The usual full-sort form (AReaL, Trinity-RFT): stable-sort all of T's d^2, exact prefix means (fsum), keep
    the leading run <= tau. Exact arithmetic, so it agrees with Algorithm 1 wherever a mean is not within rounding
    of tau."""
    flat_d, flat_a, flat_m = d.ravel(), a.ravel(), mask.ravel()
    t = [i for i in range(flat_d.size) if flat_m[i] and ((flat_a[i] > 0 and flat_d[i] > 0)
                                                        or (flat_a[i] < 0 and flat_d[i] < 0))]
    sq = {i: f32(float(flat_d[i]) * float(flat_d[i])) for i in t}
    order = sorted(t, key=lambda i: (sq[i], i))
    keep = [bool(m) for m in flat_m]
    total, kept = [], 0
    for n, i in enumerate(order, 1):
        total.append(sq[i])
        if math.fsum(total) / n > tau:
            break
        kept = n
    for i in order[kept:]:
        keep[i] = False
    return np.array(keep).reshape(d.shape).tolist()


def check(d: np.ndarray, a: np.ndarray, mask: np.ndarray, tau: float, where: str, *, full_sort: bool = True) -> None:
    d_t, a_t, m_t = torch.from_numpy(d), torch.from_numpy(a), torch.from_numpy(mask)
    ctx = f"{where}: tau={tau!r}\nd={d.tolist()}\na={a.tolist()}\nmask={mask.tolist()}"
    got = select_m2po(d_t, a_t, m_t, tau)
    previous = sort_selection(d_t, a_t, m_t, tau)
    expected = reference_m2po(d.tolist(), a.tolist(), mask.tolist(), tau)
    assert torch.equal(got.keep_mask, previous["keep_mask"]), ctx
    assert got.keep_mask.tolist() == expected["keep"], ctx
    if full_sort:
        assert got.keep_mask.tolist() == full_sort_keep(d, a, mask, tau), ctx
    assert torch.equal(got.trust_region, previous["trust_region"]), ctx
    for key in ("num_valid", "num_trust_region", "num_masked"):
        assert getattr(got, key) == previous[key] == expected[key], (key, ctx)
    for key in ("m2_before", "m2_after"):
        assert getattr(got, key) == pytest.approx(expected[key], rel=1e-12, abs=1e-300), (key, ctx)
    assert got.m2_after <= tau, ctx


# --- generators -------------------------------------------------------------------------------------------------


def _quadrant_advantages(rng: np.random.Generator, d: np.ndarray, in_t: float) -> np.ndarray:
    """Advantages putting about ``in_t`` of the tokens in T (sign of d), the rest outside (opposite sign or 0)."""
    inside = rng.random(d.shape) < in_t
    outside = np.where(rng.random(d.shape) < 0.5, -np.sign(d), 0.0)
    return np.where(inside, np.sign(d) * rng.choice([0.5, 1.0, 2.0], d.shape), outside).astype(np.float32)


def ties_at_boundary(rng: np.random.Generator):
    """Many tokens of exactly one high value, a low body, and tau placed so that the run stops inside the ties."""
    n = int(rng.integers(5, 400))
    tie = np.float32(rng.choice([0.3, 0.5, 0.25, 1.1, 0.7001]))
    d = rng.normal(0.0, 0.05, n).astype(np.float32)
    d[rng.random(n) < rng.uniform(0.1, 0.8)] = tie * rng.choice([-1, 1])
    a = np.sign(d).astype(np.float32)  # all in T
    sq = np.sort(np.array([f32(float(x) * float(x)) for x in d]))
    tau = float(np.mean(sq) * rng.uniform(0.3, 1.0))
    return d.reshape(1, -1), a.reshape(1, -1), np.ones((1, n), dtype=bool), tau


def all_or_none_in_t(rng: np.random.Generator):
    rows, cols = int(rng.integers(1, 5)), int(rng.integers(1, 30))
    d = rng.normal(0.0, rng.choice([0.05, 0.3, 1.0]), (rows, cols)).astype(np.float32)
    kind = rng.integers(0, 3)
    if kind == 0:  # all in T
        a = np.sign(d).astype(np.float32)
    elif kind == 1:  # none: opposite signs
        a = -np.sign(d).astype(np.float32)
    else:  # none: zero advantages
        a = np.zeros_like(d)
    return d, a, np.ones(d.shape, dtype=bool), float(rng.choice([0.0, 0.01, 0.04, 0.5]))


def single_token(rng: np.random.Generator):
    d = np.array([[rng.choice([-1, 1]) * rng.choice([0.1, 0.2, 0.19999999, 3.0, 1e-30, 1e20])]], dtype=np.float32)
    a = np.array([[rng.choice([-1.0, 0.0, 1.0])]], dtype=np.float32)
    return d, a, np.array([[bool(rng.random() < 0.9)]]), float(rng.choice([0.0, 0.04, 0.01, 0.0399999]))


def magnitudes(rng: np.random.Generator):
    """Huge and tiny: d^2 overflowing to inf, subnormal, underflowing to 0, and 1e-3 .. 1e3 in one batch."""
    n = int(rng.integers(1, 200))
    exps = rng.uniform(-25, 21, n)
    d = (10.0 ** exps * rng.choice([-1, 1], n)).astype(np.float32)
    a = _quadrant_advantages(rng, d, 0.7)
    tau = float(rng.choice([0.0, 1e-40, 1e-30, 0.04, 10.0, 1e30, 1e300]))
    return d.reshape(1, -1), a.reshape(1, -1), np.ones((1, n), dtype=bool), tau


def last_ulp(rng: np.random.Generator):
    """float32 values one or two ulps apart whose squares straddle tau, with ties among them."""
    tau = float(rng.choice([0.04, 0.1, 1 / 3, 0.7, 2.2]))
    base = np.float32(math.sqrt(tau))
    near = [base]
    for _ in range(3):
        near.append(np.nextafter(near[-1], np.float32(9)))
        near.insert(0, np.nextafter(near[0], np.float32(0)))
    n = int(rng.integers(2, 60))
    d = rng.choice(np.array(near, dtype=np.float32), n)
    low = rng.random(n) < rng.uniform(0, 0.6)
    d = np.where(low, np.float32(0.01), d).astype(np.float32) * rng.choice([-1, 1], n).astype(np.float32)
    a = np.sign(d).astype(np.float32)
    return d.reshape(1, -1), a.reshape(1, -1), np.ones((1, n), dtype=bool), tau


def mean_equals_tau(rng: np.random.Generator):
    """tau exactly the computed mean of the k smallest values of T: the stopping rule's equality case."""
    n = int(rng.integers(1, 80))
    d = (rng.integers(-12, 13, n) / rng.choice([4.0, 16.0, 10.0])).astype(np.float32)
    a = np.sign(d).astype(np.float32)
    sq = sorted(f32(float(x) * float(x)) for x in d if x != 0)
    tau = 0.04
    if sq:
        k = int(rng.integers(1, len(sq) + 1))
        tau = math.fsum(sq[:k]) / k
    return d.reshape(1, -1), a.reshape(1, -1), np.ones((1, n), dtype=bool), tau


def tau_below_a_float32(rng: np.random.Generator):
    """tau one float64 ulp below a float32 value that tokens hold: the radix select must hand over to the sort."""
    x = np.float32(rng.choice([0.25, 0.04, 0.3]))
    tau = math.nextafter(float(x), 0.0)
    n = int(rng.integers(2, 50))
    d = np.where(rng.random(n) < 0.5, np.float32(math.sqrt(float(x))), np.float32(0.1)).astype(np.float32)
    d = np.where(np.array([f32(float(v) * float(v)) for v in d]) > tau, d, np.float32(0.05)).astype(np.float32)
    d[0] = np.float32(1e-10)  # a low square with far lower bits: the low sum is no longer exact in float64
    a = np.ones_like(d)
    return d.reshape(1, -1), a.reshape(1, -1), np.ones((1, n), dtype=bool), tau


def stale_batch(rng: np.random.Generator):
    """A realistic stale batch: most |d| ~ 0.05-0.1, a heavy tail, padding holding garbage, zero-advantage rows."""
    rows, cols = int(rng.integers(1, 12)), int(rng.integers(1, 300))
    d = rng.normal(0.0, 0.08, (rows, cols))
    tail = rng.random((rows, cols)) < 0.05
    d = np.where(tail, rng.uniform(0.2, 2.0, (rows, cols)) * rng.choice([-1.0, 1.0], (rows, cols)), d)
    a = np.repeat(rng.choice([-1.0, 0.0, 1.0], (rows, 1)), cols, axis=1)
    mask = np.arange(cols)[None, :] < rng.integers(0, cols + 1, rows)[:, None]
    d = np.where(mask, d, np.nan).astype(np.float32)
    a = np.where(mask, a, np.inf).astype(np.float32)
    return d, a, mask, float(rng.choice([0.01, 0.04, 0.1]))


GENERATORS: dict[str, Callable] = {
    "ties_at_boundary": ties_at_boundary, "all_or_none_in_t": all_or_none_in_t, "single_token": single_token,
    "magnitudes": magnitudes, "last_ulp": last_ulp, "mean_equals_tau": mean_equals_tau,
    "tau_below_a_float32": tau_below_a_float32, "stale_batch": stale_batch,
}
# Where the radix select must decide alone: the fallback is for exact ties with tau and pathological magnitudes.
NO_FALLBACK = ("ties_at_boundary", "all_or_none_in_t", "last_ulp", "stale_batch")


@pytest.mark.parametrize("name", list(GENERATORS))
def test_matches_sort_reference_and_full_sort(name, path, counter):
    rng = np.random.default_rng(sum(map(ord, name)))
    cases = 60 if name == "stale_batch" else 150
    for i in range(cases):
        d, a, mask, tau = GENERATORS[name](rng)
        # the exact-arithmetic full sort can differ from Algorithm 1's float64 means only at a tie with tau
        check(d, a, mask, tau, where=f"{name} {i} ({path})", full_sort=name not in ("mean_equals_tau",
                                                                                     "tau_below_a_float32"))
    if name in NO_FALLBACK:
        assert counter.fallbacks == 0
    if name == "tau_below_a_float32":  # the static condition always hands over
        assert counter.fallbacks > 0


def test_the_radix_select_decides_the_existing_random_cases_alone(path, counter):
    # the existing literal-loop comparison's generator (tests/unit/test_m2po_reference.py), equality cases included
    import test_m2po_reference as existing

    rng = np.random.default_rng(4321)
    for i in range(600):
        d, a, mask, tau = existing._random_case(rng)
        check(d, a, mask, tau, where=f"existing generator {i} ({path})", full_sort=False)
    assert counter.fallbacks == 0


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_slices_and_paths(monkeypatch, path, chunk):
    monkeypatch.setattr(algo, "_CPU_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for i in range(40):
        name = list(GENERATORS)[i % len(GENERATORS)]
        d, a, mask, tau = GENERATORS[name](rng)
        check(d, a, mask, tau, where=f"chunk {chunk} {name} {i}", full_sort=False)


def test_large_tie_run_beyond_one_search_round(path, counter):
    # 5,000 equal values: the tie search needs two of its rounds; the boundary lands inside the run
    n_tie, n_low = 5000, 3000
    d = np.concatenate([np.full(n_tie, 0.5, dtype=np.float32), np.full(n_low, 0.1, dtype=np.float32)])
    a = np.ones_like(d)
    for tau in (0.02, 0.05, 0.1, 0.11, 0.2, 0.24):
        check(d.reshape(1, -1), a.reshape(1, -1), np.ones((1, d.size), dtype=bool), tau, where=f"tau {tau}")
    assert counter.fallbacks == 0


def _sorted_run(values: torch.Tensor, low_sum: float, low_count: float, tau: float) -> int:
    """K as the sort computes it (``_sort_decision``)."""
    s = torch.sort(values.double()).values
    within = (low_sum + torch.cumsum(s, 0)) / (low_count + torch.arange(1, s.numel() + 1, dtype=torch.float64))
    return int((within <= tau).to(torch.int64).cumprod(0).sum())


@pytest.mark.parametrize("bit", [28, 24, 20, 19, 12, 10, 9, 3, 0])
def test_boundary_inside_each_histogram_level(bit):
    # high values whose bit patterns first differ at ``bit``: the first, second or third pass must tell them apart
    base = int(np.float32(4.0).view(np.int32)) & ~((1 << (bit + 1)) - 1)
    lo_key, hi_key = base, base | (1 << bit)
    keys = torch.tensor([hi_key, lo_key, hi_key, lo_key, lo_key, hi_key], dtype=torch.int32)
    values = keys.view(torch.float32)
    z = torch.zeros((), dtype=torch.float64)
    lo_v, hi_v = float(values.min()), float(values.max())
    checked = 0
    for low_count in (0.0, 3.0, 40.0):
        n = low_count + 6
        # tau between the means reachable by keeping 1..6 of the values (all below the smallest value: all high)
        for kept in range(7):
            tau = (min(kept, 3) * lo_v + max(kept - 3, 0) * hi_v) / max(low_count + kept, 1) * (1 + 1e-9)
            if not 0 < tau < lo_v:
                continue
            b = radix.find_boundary(keys, torch.zeros((), dtype=torch.int64), z, z + low_count, z + n, tau,
                                    narrow=bool(bit % 2))
            assert bool(b.exact)
            assert int(b.kept) == _sorted_run(values, 0.0, low_count, tau), (bit, low_count, tau)
            assert int(b.high) == 6 and float(b.high_sum) == pytest.approx(float(values.double().sum()))
            checked += 1
    assert checked >= 6


def test_find_boundary_returns_device_tensors_after_a_fixed_number_of_passes():
    # every output stays a tensor on the keys' device (nothing is read back to the host); the work is LEVELS and
    # ROUNDS, whatever the data
    keys = torch.tensor([0.5, 0.5, 0.5, 0.9], dtype=torch.float32).view(torch.int32)
    z = torch.zeros((), dtype=torch.float64)
    b = radix.find_boundary(keys, torch.zeros((), dtype=torch.int64), z, z + 10, z + 14, 0.1)
    for value in (b.key, b.keep_ties, b.kept, b.kept_sum, b.high, b.high_sum, b.exact):
        assert isinstance(value, torch.Tensor) and value.dim() == 0
    # ten low zeros: 0.5/11 and 1.0/12 are <= 0.1, 1.5/13 is not: two of the three ties kept, 0.9 masked
    assert float(b.key.reshape(1).view(torch.float32)) == 0.5
    assert int(b.kept) == 2 and int(b.keep_ties) == 2 and float(b.kept_sum) == 1.0
    assert bool(b.exact)


def test_float32_floor_is_the_largest_float32_not_above_tau():
    for tau in (0.0, 0.04, 0.1, 1 / 3, 1e-45, 1e300, float(np.float32(0.3))):
        lo = radix.float32_floor(tau)
        assert lo <= tau and float(np.float32(lo)) == lo
        with np.errstate(over="ignore"):
            assert float(np.nextafter(np.float32(lo), np.float32(np.inf))) > tau
