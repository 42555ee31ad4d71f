"""Per-run outcome metrics for pre-registered claims, computed from a summary's eval curve.

Primary (paired by seed across cells, less noisy than one eval): ``last3`` = mean of the last 3 evals, ``auc`` =
area under the eval curve (trapezoid over steps, divided by the step span, so it is a mean accuracy on the 0-1
scale). Secondary: ``final`` (the last eval). Collapse diagnostics: ``peak_drop`` = the peak of the evals in an early
window minus the mean of the final window, and ``collapsed`` (see :func:`collapsed`).

A run that diverged (``status: diverged``: its loss or log-probs became non-finite) keeps the evals it made; its
policy is unusable from then on, so every scheduled eval after the divergence counts as accuracy 0 (the curve is
filled up to ``steps_planned`` at the run's eval spacing). It therefore enters every claim, as a collapse, instead
of being dropped as missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

EVAL_METRICS = ("last3", "auc", "final", "peak_drop")
#: Run statuses whose numbers enter the claims (a failed run, e.g. a crash, is not an outcome of the method).
OUTCOME_STATUSES = ("finished", "diverged")


@dataclass(frozen=True)
class CollapseRule:
    """A run collapses when its eval is >= ``drop`` below its running best for ``consecutive`` consecutive evals,
    counting only evals at steps >= ``after_step``; a diverged run collapses. ``early_end``: the last step of the
    early window whose peak ``peak_drop`` compares with the mean of the last ``final_evals`` evals."""

    after_step: int = 100
    drop: float = 0.10
    consecutive: int = 2
    early_end: int = 150
    final_evals: int = 3

    @classmethod
    def from_spec(cls, d: Optional[Mapping[str, Any]], where: str = "claims.collapse") -> "CollapseRule":
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected some of "
                             f"{', '.join(cls.__dataclass_fields__)}")
        rule = cls(**d)
        for key in ("after_step", "consecutive", "early_end", "final_evals"):
            v = getattr(rule, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key in ("after_step", "early_end") else 1):
                raise ValueError(f"{where}.{key}={v!r}: expected an integer >= "
                                 f"{0 if key in ('after_step', 'early_end') else 1}")
        if isinstance(rule.drop, bool) or not isinstance(rule.drop, (int, float)) or not 0 < rule.drop <= 1:
            raise ValueError(f"{where}.drop={rule.drop!r}: expected a number in (0, 1], e.g. 0.1")
        return rule


def _spacing(steps: Sequence[int]) -> Optional[int]:
    gaps = sorted(b - a for a, b in zip(steps, steps[1:]) if b > a)
    return gaps[len(gaps) // 2] if gaps else None


def eval_curve(summary: Mapping[str, Any]) -> list[tuple[int, float]]:
    """(step, accuracy) of the run's evals; for a diverged run, zeros at the scheduled evals after it stopped."""
    pts = [(int(s), float(v)) for s, v in (summary.get("curves") or {}).get("eval/accuracy", [])
           if isinstance(v, (int, float)) and math.isfinite(v)]
    if summary.get("status") != "diverged":
        return pts
    every = summary.get("eval_every") or _spacing([s for s, _ in pts])
    end = int(summary.get("steps_planned") or 0)
    last = pts[-1][0] if pts else 0
    if every:
        step = (last // every + 1) * every
        while step < end:
            pts.append((step, 0.0))
            step += every
    if end > last:
        pts.append((end, 0.0))  # the final eval is always scheduled
    return pts


def auc(points: Sequence[tuple[int, float]]) -> Optional[float]:
    """Trapezoid area under the curve divided by its step span (a mean accuracy); one point: its value."""
    if not points:
        return None
    if len(points) == 1 or points[-1][0] == points[0][0]:
        return points[-1][1]
    area = math.fsum((s2 - s1) * (v1 + v2) / 2 for (s1, v1), (s2, v2) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def collapsed(summary: Mapping[str, Any], rule: CollapseRule) -> Optional[bool]:
    """The pre-registered collapse rule on one run (None: no evals to judge)."""
    if summary.get("status") == "diverged":
        return True
    pts = eval_curve(summary)
    if not pts:
        return None
    best, run = -math.inf, 0
    for step, v in pts:
        if step >= rule.after_step and v <= best - rule.drop:
            run += 1
            if run >= rule.consecutive:
                return True
        else:
            run = 0
        best = max(best, v)
    return False


def run_metric(summary: Mapping[str, Any], metric: str, rule: CollapseRule = CollapseRule()) -> Optional[float]:
    """One run's value of an eval metric (``EVAL_METRICS``) or of a summary field path (``grad_norm.mean``,
    ``fractions.m2po/masked_fraction``)."""
    if metric in EVAL_METRICS:
        pts = eval_curve(summary)
        if not pts:
            return None
        if metric == "final":
            return pts[-1][1]
        if metric == "auc":
            return auc(pts)
        tail = pts[-rule.final_evals:] if metric == "peak_drop" else pts[-3:]
        tail_mean = math.fsum(v for _, v in tail) / len(tail)
        if metric == "last3":
            return tail_mean
        early = [v for s, v in pts if s <= rule.early_end]
        return (max(early) - tail_mean) if early else None
    if metric.startswith("fractions."):  # keys contain '/', not nested
        v = (summary.get("fractions") or {}).get(metric.split(".", 1)[1])
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
    node: Any = summary
    for part in metric.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    ok = isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node)
    return float(node) if ok else None
