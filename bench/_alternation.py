"""Alternating systems in one benchmark run, and the ratio with its spread (bench/trl_vs_stalerl.py).

Load on a shared machine drifts over minutes; measuring system A for ten minutes and then B for ten puts the drift
into the ratio. Instead every round runs each system once (a short run), in an order that reverses every round
(A B, B A, A B, ...: a load that rises or falls linearly over two rounds hits both equally), and the ratio is taken
per round, between runs minutes apart. The spread of the per-round ratios (min / median / max) says how much the
load moved the figure; the pooled ratio is the one over all rounds' steady steps.
"""

from __future__ import annotations

import statistics
from typing import Sequence


def run_order(systems: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, system) in the order to run them: the systems' order reversed in every odd round."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out = []
    for r in range(rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        out.extend((r, s) for s in order)
    return out


def steady(durations: Sequence[float], warmup: int) -> list[float]:
    """The steps after the first ``warmup`` (start-up, pipeline filling); an error if none is left."""
    rest = list(durations[warmup:])
    if not rest:
        raise ValueError(f"{len(durations)} step durations with warmup {warmup}: no steady step left")
    return rest


def seconds_per_step(durations: Sequence[float]) -> float:
    """The mean: what throughput is (a window's wall time / its steps), unlike the median."""
    return statistics.fmean(durations)


def round_ratios(baseline: Sequence[float], other: Sequence[float]) -> list[float]:
    """Per round: steps/s of ``other`` over steps/s of ``baseline`` = baseline s/step / other s/step."""
    if len(baseline) != len(other):
        raise ValueError(f"{len(baseline)} baseline rounds against {len(other)}")
    return [b / o for b, o in zip(baseline, other)]


def pooled_ratio(baseline: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> float:
    """steps/s ratio over every round's steady steps together (each system's total time / total steps)."""
    b = [d for r in baseline for d in r]
    o = [d for r in other for d in r]
    return seconds_per_step(b) / seconds_per_step(o)


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    if not values:
        raise ValueError("no values")
    return min(values), statistics.median(values), max(values)


def format_ratio(pooled: float, per_round: Sequence[float]) -> str:
    lo, mid, hi = spread(per_round)
    return (f"{pooled:.2f}x (per round: min {lo:.2f} / median {mid:.2f} / max {hi:.2f}, {len(per_round)} "
            f"round{'s' if len(per_round) != 1 else ''})")


def paired_difference(baseline: Sequence[Sequence[float]],
                      other: Sequence[Sequence[float]]) -> tuple[float, float, int]:
    """Mean and standard error of ``other - baseline`` over steps paired by (round, step index): both systems get
    the same questions at the same step, so the pairing removes the questions' difficulty from the comparison of
    per-step means (a reward). Rounds and steps beyond the shorter side are left out. (mean, se, pairs); se is
    nan with one pair."""
    diffs = [o - b for rb, ro in zip(baseline, other) for b, o in zip(rb, ro)]
    if not diffs:
        raise ValueError("no paired steps")
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs), se, len(diffs)
