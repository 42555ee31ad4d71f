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
