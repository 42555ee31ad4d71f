"""Interval arithmetic for the study report: the mean over seeds and a two-sided 95% Student-t interval on it.

    half_width = t_{0.975, n-1} * s / sqrt(n),   s = sample standard deviation (n - 1 in the denominator)

No scipy: the quantiles for 1..30 degrees of freedom are tabulated (to 6 decimals); above 30 the Cornish-Fisher
expansion of the t quantile around the normal one is used (error < 1e-5 there). n = 1 has no interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

# t_{0.975, df} for df = 1..30.
_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
         2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
         2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


@dataclass(frozen=True)
class Estimate:
    n: int
    mean: Optional[float]
    half_width: Optional[float]  # None when n < 2

    @property
    def low(self) -> Optional[float]:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> Optional[float]:
        return None if self.half_width is None else self.mean + self.half_width


def mean_interval(values: Sequence[float]) -> Estimate:
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Estimate(0, None, None)
    mean = math.fsum(xs) / n
    if n == 1:
        return Estimate(1, mean, None)
    s = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    return Estimate(n, mean, t_quantile_975(n - 1) * s / math.sqrt(n))


def format_estimate(est: Estimate, digits: int = 3) -> str:
    """``0.412 ± 0.051``; ``0.412 (n=1)`` without an interval; ``-`` when nothing was measured."""
    if est.mean is None:
        return "-"
    if est.half_width is None:
        return f"{est.mean:.{digits}f} (n=1)"
    hw = est.half_width if est.half_width > 0 else 0.0  # never print "-0.000"
    return f"{est.mean:.{digits}f} ± {hw:.{digits}f}"


# ------------------------------------------------------------------------------------------------ tests that can fail
# The claims of a study are hypothesis tests with p-values (stalerl_study.prereg), so they can be corrected for
# multiplicity (Holm) and can come out against. Everything below is plain math (no scipy);
# tests/unit/test_report_prereg.py compares each function with a literal, slow reference (numerical integration,
# enumeration).


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz; Numerical Recipes' betacf)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"regularized_beta: x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    ln_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    front = math.exp(ln_front)
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T >= t) for Student's t with ``df`` degrees of freedom (the one-sided upper tail)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T >= |t|)
    return tail if t >= 0 else 1.0 - tail


def t_quantile(p: float, df: float) -> float:
    """The p quantile of Student's t (bisection on t_sf: slow but exact to 1e-10, used only for margins)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 1.0 - t_sf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class PairedTest:
    """One-sample t statistics of paired differences: mean, standard error, degrees of freedom (n - 1)."""

    n: int
    mean: Optional[float]
    se: Optional[float]  # None when n < 2

    @property
    def df(self) -> int:
        return self.n - 1

    def p_greater(self, margin: float = 0.0) -> Optional[float]:
        """One-sided p-value of H0: mean <= margin against H1: mean > margin (None when n < 2)."""
        if self.se is None:
            return None
        if self.se == 0.0:  # every difference equal: the data decide without noise
            return 0.0 if self.mean > margin else 1.0
        return t_sf((self.mean - margin) / self.se, self.df)

    def p_less(self, margin: float = 0.0) -> Optional[float]:
        """One-sided p-value of H0: mean >= margin against H1: mean < margin."""
        if self.se is None:
            return None
        if self.se == 0.0:
            return 0.0 if self.mean < margin else 1.0
        return t_sf((margin - self.mean) / self.se, self.df)

    def p_equivalent(self, margin: float) -> Optional[float]:
        """Two one-sided tests (TOST): H0 |mean| >= margin against H1 |mean| < margin; p = the larger of the two."""
        lo, hi = self.p_greater(-margin), self.p_less(margin)
        return None if lo is None else max(lo, hi)

    def interval(self, alpha: float) -> Optional[tuple[float, float]]:
        """The two-sided (1 - 2 alpha) interval that TOST at level alpha is equivalent to."""
        if self.se is None:
            return None
        q = t_quantile(1.0 - alpha, self.df) * self.se
        return self.mean - q, self.mean + q


def paired_test(diffs: Sequence[float]) -> PairedTest:
    xs = [float(v) for v in diffs]
    n = len(xs)
    if n == 0:
        return PairedTest(0, None, None)
    mean = math.fsum(xs) / n
    if n == 1:
        return PairedTest(1, mean, None)
    s = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    return PairedTest(n, mean, s / math.sqrt(n))


def holm_adjust(pvalues: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Holm's step-down adjusted p-values (family-wise error <= alpha when adjusted p <= alpha is rejected).

    Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)). ``None`` (a claim
    that could not be tested) still counts in m, so an untestable claim never makes the others easier to pass.
    """
    m = len(pvalues)
    order = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    out: list[Optional[float]] = [None] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_greater(a_events: int, a_n: int, b_events: int, b_n: int) -> float:
    """One-sided Fisher exact p-value that group a has the higher event rate: P(X >= a_events) under the
    hypergeometric law of the 2x2 table with its margins fixed (H0: equal rates)."""
    for name, v in (("a_events", a_events), ("a_n", a_n), ("b_events", b_events), ("b_n", b_n)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"fisher_greater: {name} must be a non-negative integer, got {v!r}")
    if a_events > a_n or b_events > b_n:
        raise ValueError(f"fisher_greater: events exceed runs ({a_events}/{a_n}, {b_events}/{b_n})")
    total, events = a_n + b_n, a_events + b_events
    if total == 0:
        return 1.0
    denom = _log_choose(total, events)
    hi = min(a_n, events)
    return min(1.0, math.fsum(math.exp(_log_choose(a_n, k) + _log_choose(b_n, events - k) - denom)
                              for k in range(a_events, hi + 1)))


# ------------------------------------------------------------------------------------------------ exact sign flips
# A secondary, assumption-light view of each paired claim: under H0 the paired differences are symmetric about 0 (or
# about the margin), so every one of the 2^n sign patterns of |d_i| is equally likely. Exact for n <= SIGN_FLIP_MAX_N;
# its smallest possible p is 1/2^n (1/256 at 8 seeds). tests/unit/test_power.py compares it with a literal
# enumeration of every sign vector.
SIGN_FLIP_MAX_N = 20


def sign_flip_p(diffs: Sequence[float], alternative: str, shift: float = 0.0) -> Optional[float]:
    """Exact one-sided sign-flip p of ``mean(diffs - shift)``: the share of the 2^n sign patterns whose sum is at
    least (``greater``) / at most (``less``) the observed one; ties (within 1e-9 relative) count as extreme. None when
    n = 0 or n > SIGN_FLIP_MAX_N."""
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    xs = [float(d) - shift for d in diffs]
    n = len(xs)
    if n == 0 or n > SIGN_FLIP_MAX_N:
        return None
    observed = math.fsum(xs)
    tol = 1e-9 * max(1.0, math.fsum(abs(x) for x in xs))
    sums = [0.0]
    for x in xs:  # all 2^n signed sums, built by doubling
        a = abs(x)
        sums = [s + a for s in sums] + [s - a for s in sums]
    if alternative == "greater":
        hits = sum(1 for s in sums if s >= observed - tol)
    else:
        hits = sum(1 for s in sums if s <= observed + tol)
    return hits / len(sums)


def sign_flip_equivalence_p(diffs: Sequence[float], margin: float) -> Optional[float]:
    """TOST with sign flips: the larger of the two one-sided p's against -margin and +margin."""
    lo, hi = sign_flip_p(diffs, "greater", -margin), sign_flip_p(diffs, "less", margin)
    return None if lo is None else max(lo, hi)


# ------------------------------------------------------------------------------------------------ power
# Power of the registered paired tests for normal paired differences with a stated SD, integrated exactly over the
# sampling distribution of the sample SD ((n-1) s^2 / sd^2 ~ chi^2_{n-1}): no normal approximation of t. The tests
# (tests/unit/test_power.py) compare it with simulated studies.


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _sd_ratio_expectation(f, df: int, points: int = 2000) -> float:
    """E[f(u)] for u = s / sd, (df) u^2 ~ chi^2_df, by Simpson's rule on u in [0, u_max]."""
    u_max = math.sqrt((df + 12.0 * math.sqrt(2.0 * df) + 40.0) / df)
    h = u_max / points
    log_norm = (df / 2.0) * math.log(df / 2.0) - math.lgamma(df / 2.0) + math.log(2.0)

    def density(u: float) -> float:  # of u = sqrt(X / df), X ~ chi^2_df
        if u <= 0.0:
            return 0.0
        return math.exp(log_norm + (df - 1) * math.log(u) - df * u * u / 2.0)

    total = 0.0
    for i in range(points + 1):
        u = i * h
        w = 1 if i in (0, points) else (4 if i % 2 else 2)
        total += w * density(u) * f(u)
    return total * h / 3.0


def power_one_sided(effect: float, sd: float, n: int, alpha: float) -> float:
    """P(the one-sided paired t-test at level alpha holds) when the true mean difference is ``effect`` (in the claimed
    direction) and the differences are normal with SD ``sd``."""
    if n < 2 or not sd > 0:
        raise ValueError(f"power needs n >= 2 seeds and sd > 0, got n={n}, sd={sd}")
    t = t_quantile(1.0 - alpha, n - 1)
    z = effect * math.sqrt(n) / sd
    return _sd_ratio_expectation(lambda u: _phi(z - t * u), n - 1)


def power_equivalence(true_diff: float, sd: float, n: int, alpha: float, margin: float) -> float:
    """P(TOST at level alpha shows |difference| < margin) for a true mean difference ``true_diff``."""
    if n < 2 or not sd > 0:
        raise ValueError(f"power needs n >= 2 seeds and sd > 0, got n={n}, sd={sd}")
    t = t_quantile(1.0 - alpha, n - 1)
    k = math.sqrt(n) / sd

    def inside(u: float) -> float:
        hi, lo = (margin - true_diff) * k - t * u, (-margin - true_diff) * k + t * u
        return max(0.0, _phi(hi) - _phi(lo))

    return _sd_ratio_expectation(inside, n - 1)


def minimum_detectable_effect(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The smallest true difference the one-sided paired t-test detects with the given power (bisection)."""
    lo, hi = 0.0, 50.0 * sd
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if power_one_sided(mid, sd, n, alpha) < power:
            lo = mid
        else:
            hi = mid
    return hi


def equivalence_margin_needed(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The smallest margin that TOST shows with the given power when the true difference is 0 (bisection)."""
    lo, hi = 0.0, 50.0 * sd
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if power_equivalence(0.0, sd, n, alpha, mid) < power:
            lo = mid
        else:
            hi = mid
    return hi
