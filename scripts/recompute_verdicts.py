#!/usr/bin/env python3
"""Recompute a pre-registered study's verdicts from its committed summaries, independently of ``stalerl_study``.

    python3 scripts/recompute_verdicts.py docs/algorithms/results/smollm2_study --doc docs/algorithms/m2po.md

Reads ``study.json`` (the registered claims and method keys) and the run summaries beside it, and recomputes every
claim with its own code: the per-run metric from the eval curve (a diverged run filled with accuracy 0 at the
scheduled evals after it stopped), the paired one-sample t-test with the Student t tail integrated numerically
(Simpson's rule on x = sqrt(df) tan(theta), not the incomplete beta function the report uses), Fisher's exact test by
enumerating the hypergeometric table, and Holm's step-down adjustment written out literally (primary and secondary
claims as separate families, claims and their opposites as separate families). With ``--doc`` it reads the
verdicts the document's results block prints for the study and exits 1 if any differs (0 when all agree). Only the
standard library: it shares no code with the report, so an agreement is a recomputation, not a rerun of the same
functions.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Optional

OUTCOMES = ("finished", "diverged")


# ------------------------------------------------------------------------------------------------ statistics
def t_tail(t: float, df: int, intervals: int = 20000) -> float:
    """P(T >= t) for Student's t with df degrees of freedom: with x = sqrt(df) tan(theta) the density times dx is
    c cos(theta)^(df-1) dtheta, c = Gamma((df+1)/2) / (sqrt(pi) Gamma(df/2)); integrated from atan(t/sqrt(df)) to
    pi/2 by Simpson's rule."""
    lo, hi = math.atan(t / math.sqrt(df)), math.pi / 2
    if hi - lo <= 0:
        return 0.0
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    h = (hi - lo) / intervals
    f = [math.cos(lo + i * h) ** (df - 1) if df > 1 else 1.0 for i in range(intervals + 1)]
    s = f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2])
    return min(1.0, max(0.0, c * s * h / 3))


def one_sided(diffs: list[float], shift: float, greater: bool) -> Optional[float]:
    """p of H1: mean > shift (greater) or mean < shift, one-sample t on the paired differences."""
    n = len(diffs)
    if n < 2:
        return None
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    if sd == 0:
        return 0.0 if (mean > shift if greater else mean < shift) else 1.0
    t = (mean - shift) / (sd / math.sqrt(n))
    return t_tail(t if greater else -t, n - 1)


def fisher_more(ka: int, na: int, kb: int, nb: int) -> float:
    """P(a's count >= ka) given the margins: a one-sided Fisher exact test that a has more events than b."""
    k, n = ka + kb, na + nb
    total = math.comb(n, k)
    return sum(math.comb(na, x) * math.comb(nb, k - x) for x in range(ka, min(na, k) + 1)) / total


def holm(ps: list[Optional[float]]) -> list[Optional[float]]:
    """Holm's step-down adjusted p-values, literally: sort, multiply the i-th smallest by (m - i), running max, cap 1.
    None (an untestable claim) stays None and still counts in m, as registered: it never eases the others."""
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    m, out, running = len(ps), [None] * len(ps), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


# ------------------------------------------------------------------------------------------------ per-run metrics
def evals(run: dict) -> list[tuple[int, float]]:
    pts = [(int(s), float(v)) for s, v in run.get("curves", {}).get("eval/accuracy", []) if v == v]
    if run.get("status") == "diverged":
        steps = [s for s, _ in pts]
        gaps = sorted(b - a for a, b in zip(steps, steps[1:]) if b > a)
        every = run.get("eval_every") or (gaps[len(gaps) // 2] if gaps else None)
        end, last = int(run.get("steps_planned") or 0), (steps[-1] if steps else 0)
        if every:
            nxt = (last // every + 1) * every
            while nxt < end:
                pts.append((nxt, 0.0))
                nxt += every
        if end > last:
            pts.append((end, 0.0))
    return pts


def metric(run: dict, name: str, rule: dict) -> Optional[float]:
    pts = evals(run)
    if name in ("last3", "final", "auc", "peak_drop"):
        if not pts:
            return None
        if name == "final":
            return pts[-1][1]
        if name == "auc":
            if len(pts) == 1 or pts[-1][0] == pts[0][0]:
                return pts[-1][1]
            return sum((s2 - s1) * (v1 + v2) / 2 for (s1, v1), (s2, v2) in zip(pts, pts[1:])) / (pts[-1][0] - pts[0][0])
        tail = pts[-3:] if name == "last3" else pts[-rule["final_evals"]:]
        tail_mean = sum(v for _, v in tail) / len(tail)
        if name == "last3":
            return tail_mean
        early = [v for s, v in pts if s <= rule["early_end"]]
        return max(early) - tail_mean if early else None
    if name.startswith("fractions."):
        node = run.get("fractions", {}).get(name.split(".", 1)[1])
    else:
        node = run
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) and node == node else None


def collapses(run: dict, rule: dict) -> Optional[bool]:
    if run.get("status") == "diverged":
        return True
    pts = evals(run)
    if not pts:
        return None
    best, streak = -math.inf, 0
    for step, v in pts:
        streak = streak + 1 if (step >= rule["after_step"] and v <= best - rule["drop"]) else 0
        if streak >= rule["consecutive"]:
            return True
        best = max(best, v)
    return False


# ------------------------------------------------------------------------------------------------ claims
def cell(text: str) -> tuple[str, str]:
    method, setting = text.split(" @ ", 1)
    return method.strip(), setting.strip()


def recompute(results: Path) -> dict[str, str]:
    study = json.loads((results / "study.json").read_text())
    claims = study["claims"]
    rule = {"after_step": 100, "drop": 0.1, "consecutive": 2, "early_end": 150, "final_evals": 3,
            **(claims.get("collapse") or {})}
    keys = study.get("method_keys") or ["loss"]
    runs: dict[tuple[str, str], dict[int, dict]] = {}
    for f in sorted(results.glob("*.json")):
        if f.name == "study.json":
            continue
        r = json.loads(f.read_text())
        if r.get("status") not in OUTCOMES:
            continue
        label = str(r.get(keys[0])) if len(keys) == 1 else ", ".join(f"{k}={r.get(k)}" for k in keys)
        runs.setdefault((label, r["setting"]), {})[int(r["seed"])] = r
    alpha = claims.get("alpha", 0.025)
    rows = []
    for c in claims["list"]:
        a, b = runs.get(cell(c["a"]), {}), runs.get(cell(c["b"]), {})
        if c["test"] == "collapses_more":
            ca = [x for x in (collapses(r, rule) for r in a.values()) if x is not None]
            cb = [x for x in (collapses(r, rule) for r in b.values()) if x is not None]
            p = q = None
            if ca and cb:
                p, q = fisher_more(sum(ca), len(ca), sum(cb), len(cb)), fisher_more(sum(cb), len(cb), sum(ca), len(ca))
        else:
            ma, mb = c.get("metric", "last3"), c.get("metric_b") or c.get("metric", "last3")
            diffs = []
            for seed in sorted(set(a) & set(b)):
                x, y = metric(a[seed], ma, rule), metric(b[seed], mb, rule)
                if x is not None and y is not None:
                    diffs.append(x - y)
            test, margin = c["test"], c.get("margin")
            if test == "greater":
                p, q = one_sided(diffs, 0.0, True), one_sided(diffs, 0.0, False)
            elif test == "less":
                p, q = one_sided(diffs, 0.0, False), one_sided(diffs, 0.0, True)
            elif test == "noninferior":
                p, q = one_sided(diffs, -margin, True), one_sided(diffs, -margin, False)
            else:  # equivalent: TOST, and the opposite (|difference| >= margin) as the smaller one-sided p
                lo, hi = one_sided(diffs, -margin, True), one_sided(diffs, margin, False)
                p = None if lo is None else max(lo, hi)
                q = None if lo is None else min(one_sided(diffs, margin, True), one_sided(diffs, -margin, False))
        rows.append((c["id"], bool(c.get("secondary", False)), p, q))
    verdicts: dict[str, str] = {}
    for family in (False, True):
        fam = [r for r in rows if r[1] == family]
        for (cid, _, _, _), pa, qa in zip(fam, holm([r[2] for r in fam]), holm([r[3] for r in fam])):
            verdicts[cid] = ("holds" if pa is not None and pa <= alpha else
                             "does not hold" if qa is not None and qa <= alpha else "not shown")
    return verdicts


def doc_verdicts(doc: Path, name: str) -> dict[str, str]:
    """The verdicts the study's results block prints: rows '| <id>: <text> | ... | **<verdict>** |'."""
    text = doc.read_text()
    m = re.search(rf"<!-- results:begin {re.escape(name)} -->(.*?)<!-- results:end {re.escape(name)} -->", text, re.S)
    if not m:
        raise SystemExit(f"{doc}: no results block for study {name!r}")
    out = {}
    for line in m.group(1).splitlines():
        row = re.fullmatch(r"\| ([^:|]+): .*\| \*\*(holds|does not hold|not shown)\*\* \|", line.strip())
        if row:
            out[row.group(1)] = row.group(2)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a study's results directory (study.json and run summaries)")
    ap.add_argument("--doc", help="compare with the verdicts this document's results block prints")
    args = ap.parse_args(argv)
    results = Path(args.results)
    study: dict[str, Any] = json.loads((results / "study.json").read_text())
    if not isinstance(study.get("claims"), dict):
        print(f"{results}: study {study.get('name')!r} has no pre-registered claims", file=sys.stderr)
        return 2
    mine = recompute(results)
    for cid, v in mine.items():
        print(f"{cid}: {v}")
    if not args.doc:
        return 0
    theirs = doc_verdicts(Path(args.doc), study["name"])
    differ = [cid for cid in mine if theirs.get(cid) != mine[cid]]
    for cid in differ:
        print(f"DIFFERS {cid}: recomputed {mine[cid]!r}, document {theirs.get(cid)!r}", file=sys.stderr)
    print(f"{len(mine) - len(differ)} of {len(mine)} verdicts agree with {args.doc}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
