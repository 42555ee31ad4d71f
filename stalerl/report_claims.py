"""The published claims, checked against a study's numbers (so the doc's verdicts are generated, never typed).

A comparison "A < B" *holds* when the 95% intervals of the two means are disjoint in that direction, *does not
hold* when they are disjoint the other way, and is *inconclusive* when they overlap (or a side has fewer than two
finished seeds). Disjoint intervals are a conservative test; the verdict is about this scale and these seeds only.

- ``staleness`` (loss x fixed_staleness; the M2PO paper): clip degrades with staleness; no trust region prospers
  then collapses; M2PO tracks on-policy; M2PO masks far fewer tokens than clip clips.
- ``async`` (AReaL's M2PO doc): GRPO's (vanilla) grad norm is higher than M2PO's; M2PO's eval accuracy is higher.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

from stalerl.report_stats import Estimate, format_estimate, mean_interval

KINDS = ("staleness", "async")


def compare(a: Estimate, b: Estimate) -> str:
    """'<', '>' when the intervals are disjoint, '~' when they overlap, '?' when one is missing (n < 2)."""
    if a.half_width is None or b.half_width is None:
        return "?"
    if a.high < b.low:
        return "<"
    if a.low > b.high:
        return ">"
    return "~"


def _verdict(results: Sequence[str], want: str) -> str:
    if results and all(r == want for r in results):
        return "**holds**"
    if any(r not in (want, "~", "?") for r in results):
        return "**does not hold**"
    return "**inconclusive**" if results else "**not measured**"


def _stale(setting: str) -> Optional[int]:
    m = re.fullmatch(r"(?:fixed_staleness|stale) (\d+).*", setting)
    return int(m.group(1)) if m else None


def _fmt(e: Estimate, digits: int = 3) -> str:
    return format_estimate(e, digits)


def staleness_claims(cells) -> list[str]:
    get: Callable[[str, str], Optional[object]] = lambda m, s: next(  # noqa: E731
        (c for c in cells if c.method == m and c.setting == s and c.finished), None)
    settings = sorted({c.setting for c in cells if _stale(c.setting) is not None}, key=_stale)
    on = next((s for s in settings if _stale(s) == 0), None)
    stale = [s for s in settings if _stale(s)]
    out = []
    # 1. Clip degrades with staleness: vanilla's final eval below its on-policy value.
    base = get("vanilla", on) if on else None
    res, parts = [], []
    for s in stale:
        c = get("vanilla", s)
        if base and c:
            res.append(compare(c.estimate("eval.final"), base.estimate("eval.final")))
            parts.append(f"{s}: {_fmt(c.estimate('eval.final'))}")
    if base:
        parts.insert(0, f"on-policy {_fmt(base.estimate('eval.final'))}")
    out.append(f"Clip (vanilla/GRPO) degrades with staleness (final eval below on-policy at every S > 0): "
               f"{_verdict(res, '<')} ({'; '.join(parts) or 'no data'}).")
    # 2. No trust region prospers then collapses: per seed, best eval minus final eval, above 0 at the largest S.
    if stale and get("no_trust_region", stale[-1]):
        c = get("no_trust_region", stale[-1])
        drop = mean_interval([r["eval"]["best"] - r["eval"]["final"] for r in c.finished
                              if r["eval"].get("best") is not None and r["eval"].get("final") is not None])
        r = compare(Estimate(1, 0.0, 0.0), drop)
        out.append(f"No trust region prospers then collapses (at {stale[-1]}, best minus final eval above 0): "
                   f"{_verdict([r], '<')} (drop {_fmt(drop)}).")
    else:
        out.append("No trust region prospers then collapses: **not measured**.")
    # 3. M2PO tracks on-policy: intervals overlap with on-policy M2PO at every S (or M2PO is above it).
    base = get("m2po", on) if on else None
    res, parts = [], []
    for s in stale:
        c = get("m2po", s)
        if base and c:
            r = compare(c.estimate("eval.final"), base.estimate("eval.final"))
            res.append({"~": "=", ">": "="}.get(r, r))  # overlapping or above on-policy: tracks it
            parts.append(f"{s}: {_fmt(c.estimate('eval.final'))}")
    if base:
        parts.insert(0, f"on-policy {_fmt(base.estimate('eval.final'))}")
    verdict = _verdict(res, "=")
    if verdict == "**holds**":  # overlap is consistency with on-policy, not a proof of equality
        verdict = "**consistent**"
    out.append(f"M2PO tracks on-policy (final eval not below on-policy M2PO at any S): {verdict} "
               f"({'; '.join(parts) or 'no data'}).")
    # 4. M2PO masks far fewer tokens than clip clips.
    res, parts = [], []
    for s in stale:
        m, v = get("m2po", s), get("vanilla", s)
        if m and v:
            em, ev = m.estimate("fractions.m2po/masked_fraction"), v.estimate("fractions.vanilla/clip_fraction")
            if em.mean is not None and ev.mean is not None:
                res.append(compare(em, ev))
                parts.append(f"{s}: masked {_fmt(em, 4)} vs clipped {_fmt(ev, 4)}")
    out.append(f"M2PO masks fewer tokens than clip clips (at every S > 0): {_verdict(res, '<')} "
               f"({'; '.join(parts) or 'no data'}).")
    return out


def async_claims(cells) -> list[str]:
    settings = list(dict.fromkeys(c.setting for c in cells))
    get = lambda m, s: next((c for c in cells if c.method == m and c.setting == s and c.finished), None)  # noqa: E731
    out = []
    for label, field, want, text in (
            ("grad norm", "grad_norm.mean", ">", "GRPO's (vanilla) grad norm is higher than M2PO's"),
            ("eval", "eval.final", "<", "M2PO's final eval accuracy is higher than GRPO's (vanilla)")):
        res, parts = [], []
        for s in settings:
            v, m = get("vanilla", s), get("m2po", s)
            if v and m:
                res.append(compare(v.estimate(field), m.estimate(field)))
                parts.append(f"{s}: vanilla {_fmt(v.estimate(field))} vs m2po {_fmt(m.estimate(field))}")
        out.append(f"{text} (every setting): {_verdict(res, want)} ({'; '.join(parts) or 'no data'}).")
    return out


def render_claims(cells, kind: str) -> list[str]:
    if kind not in KINDS:
        raise ValueError(f"unknown claims kind {kind!r}; expected one of {', '.join(KINDS)}")
    claims = staleness_claims(cells) if kind == "staleness" else async_claims(cells)
    return ["Claims checked against these numbers (holds / does not hold: the 95% intervals are disjoint in / "
            "against the claimed direction; inconclusive: they overlap or have fewer than 2 seeds; consistent: "
            "overlapping with on-policy, which is what tracking predicts but does not prove):", "",
            *(f"- {c}" for c in claims)]
