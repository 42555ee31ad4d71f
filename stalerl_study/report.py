"""``stalerl-report``: tables (mean and 95% interval over seeds) and figures from run summaries.

    stalerl-report docs/algorithms/results/staleness --update-doc docs/algorithms/m2po.md
    stalerl-report runs/study-staleness --study staleness --seeds 1,2,3,4,5 --out /tmp/report

Inputs are run directories (each with the ``summary.json`` every run writes, see :mod:`stalerl.results.run_summary`),
directories holding summaries (searched recursively; ``docs/algorithms/results/<study>/*.json`` as collected by
``stalerl-study``) or summary files. A ``study.json`` next to committed summaries (written by ``stalerl-study``)
supplies the study's name, title, expected seeds, row order, command and wall time; flags override it.

Runs are grouped by method (``--method-keys``, default ``loss``) x setting (``fixed_staleness S`` for the
synchronous FIFO, AReaL's ``stale S dX+dY rollout R`` for asynchronous runs). Each cell is the mean over finished
seeds ± the half-width of the two-sided 95% Student-t interval on that mean (see :mod:`stalerl_study.stats`);
one finished seed shows ``(n=1)`` and no interval. Failed runs are listed as failed (never dropped) and expected
seeds without a summary as missing. Tables lead with held-out eval accuracy.

``--update-doc FILE`` replaces the text between ``<!-- results:begin NAME -->`` and ``<!-- results:end NAME -->``
in FILE with the generated block; ``--check`` only reports whether FILE is up to date (exit 1 if not). The
markdown depends only on the summaries and study.json (sorted, fixed formatting), so regenerating from committed
summaries reproduces it byte for byte. PNG figures are written without timestamps, but their bytes depend on the
matplotlib/freetype versions, so they are outside that guarantee.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from stalerl.core.io import atomic_write_bytes, atomic_write_text
from stalerl.results.run_summary import SUMMARY_FILE
from stalerl_study.stats import Estimate, format_estimate, mean_interval

STUDY_FILE = "study.json"
INTERVAL_NOTE = ("mean over seeds ± half-width of the two-sided 95% Student-t interval on the mean "
                 "(t_{0.975,n-1}·s/√n); `(n=1)`: a single seed, no interval")
FIGURE_METRICS = ("eval/accuracy", "reward/consumed", "actor/grad_norm")


# Where `stalerl-study run` sets aside summaries of runs its spec no longer lists (<results>/superseded/<UTC time>/);
# a report never reads them. A run directory that happens to be called "superseded" is still read. The folder's name
# is made and recognised here only, so the two cannot drift apart.
SUPERSEDED_DIR = "superseded"
_SET_ASIDE_TIME = "%Y%m%d-%H%M%S"
_SET_ASIDE_STAMP = re.compile(r"\d{8}-\d{6}(\.\d+)?")


def make_set_aside_dir(results: Path) -> Path:
    """Create and return a new, empty ``results/superseded/<UTC time>[.n]/`` (never one that already exists)."""
    base = time.strftime(_SET_ASIDE_TIME, time.gmtime())
    for n in range(1000):  # two studies set aside in the same second: never overwrite the first
        dest = results / SUPERSEDED_DIR / (base if n == 0 else f"{base}.{n}")
        try:
            dest.mkdir(parents=True)
            return dest
        except FileExistsError:
            continue
    raise RuntimeError(f"{results / SUPERSEDED_DIR}: 1000 set-aside folders for {base}; remove some")


def _set_aside(rel: Path) -> bool:
    parts = rel.parts
    return any(a == SUPERSEDED_DIR and _SET_ASIDE_STAMP.fullmatch(b) for a, b in zip(parts, parts[1:-1]))


class ReportError(ValueError):
    """A user-facing problem with the report's inputs."""


# ------------------------------------------------------------------------------------------------ loading
def is_summary(d: Any) -> bool:
    return isinstance(d, dict) and "schema" in d and "run" in d and "status" in d


def read_summary_file(f: Path) -> Optional[dict[str, Any]]:
    """The run summary in ``f``, or None when it is unreadable or not a summary (study.json, other JSON)."""
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
        return None
    return d if is_summary(d) else None


def load_summaries(paths: Iterable[os.PathLike]) -> list[dict[str, Any]]:
    """Every summary under ``paths`` (files, run directories, or trees of them), one per (experiment, run)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise ReportError(f"{p}: no such file or directory")
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*.json")
                                                if q.name != STUDY_FILE and not _set_aside(q.relative_to(p)))
        for f in files:
            d = read_summary_file(f)
            if d is not None:
                found[(d.get("experiment", ""), d["run"])] = d
    return [found[k] for k in sorted(found)]


def load_study(paths: Sequence[os.PathLike]) -> dict[str, Any]:
    for p in map(Path, paths):
        f = p / STUDY_FILE if p.is_dir() else p.parent / STUDY_FILE
        if f.is_file():
            return json.loads(f.read_text())
    return {}


# ------------------------------------------------------------------------------------------------ grouping
def method_label(summary: Mapping[str, Any], keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return str(summary.get(keys[0]))
    return ", ".join(f"{k}={summary.get(k)}" for k in keys)


def _order(seen: Iterable[str], preferred: Optional[Sequence[str]]) -> list[str]:
    seen = set(seen)
    first = list(preferred or [])  # expected entries stay even with no run (shown as missing)
    return list(dict.fromkeys([*first, *sorted(seen - set(first))]))


def _get(d: Mapping[str, Any], path: str) -> Optional[float]:
    node: Any = d
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


# Table columns: (header, summary field). Held-out eval accuracy first.
MAIN_COLUMNS = (
    ("eval acc (final)", "eval.final"),
    ("eval acc (best)", "eval.best"),
    ("eval acc (step 0)", "eval.initial"),
    ("reward generated (last 10%)", "reward.generated.last"),
    ("reward consumed (last 10%)", "reward.consumed.last"),
    ("grad norm (mean)", "grad_norm.mean"),
)
DETAIL_COLUMNS = (
    ("staleness mean", "staleness.mean"),
    ("m2po masked fraction", "fractions.m2po/masked_fraction"),
    ("clip fraction", "fractions.vanilla/clip_fraction"),
    ("wall s / run", "wall_s"),
)
# The paper's masked-vs-clipped comparison on identical tokens (issue 36 item 4): shown only in blocks whose runs
# recorded M2PO's would-clip fraction (written since that metric exists), so every earlier block regenerates as it was.
TRUST_REGION_COLUMNS = (
    ("M2 before masking (mean)", "diagnostics.actor/m2po/m2_before.mean"),
    ("M2 before masking (max)", "diagnostics.actor/m2po/m2_before.max"),
    ("M2 after masking (mean)", "diagnostics.actor/m2po/m2_after.mean"),
    ("m2po masked fraction", "fractions.m2po/masked_fraction"),
    ("clip at 0.2 would zero (same tokens)", "fractions.m2po/would_clip_fraction"),
    ("clip fraction (vanilla runs)", "fractions.vanilla/clip_fraction"),
)
# Blocks with pre-registered claims lead with the primary metrics (their paired comparisons are in the paired table).
PREREG_COLUMNS = (
    ("eval acc (mean of last 3)", "eval.last3"),
    ("eval AUC", "eval.auc"),
    ("eval acc (final)", "eval.final"),
    ("eval acc (best)", "eval.best"),
    ("eval acc (step 0)", "eval.initial"),
    ("reward generated (last 10%)", "reward.generated.last"),
    ("grad norm (mean)", "grad_norm.mean"),
)
CURVE_FIELDS = ("eval.last3", "eval.auc")  # from the eval curve: defined for diverged runs too
DIGITS = {"staleness.mean": 2, "fractions.m2po/masked_fraction": 4, "fractions.vanilla/clip_fraction": 4,
          "fractions.m2po/would_clip_fraction": 4, "diagnostics.actor/m2po/m2_after.mean": 4,
          "wall_s": 0}  # every other column: 3


def _fraction_field(summary: Mapping[str, Any], field: str) -> Optional[float]:
    if field in ("eval.last3", "eval.auc"):  # from the eval curve (stalerl_study.metrics)
        from stalerl_study.metrics import run_metric

        return run_metric(summary, field.split(".", 1)[1])
    if field.startswith("fractions."):  # keys contain '/', not nested
        v = (summary.get("fractions") or {}).get(field.split(".", 1)[1])
        return float(v) if isinstance(v, (int, float)) else None
    return _get(summary, field)


def _hist_text(hist: Sequence[int]) -> str:
    """Realised staleness as shares of samples in power-of-two bins: ``0:12% 1:30% 2-3:58%``."""
    total = sum(hist)
    if not total:
        return "-"
    parts, lo = [], 0
    while lo < len(hist):
        hi = 0 if lo == 0 else 2 * lo - 1  # bins 0, 1, 2-3, 4-7, ...
        share = sum(hist[lo:hi + 1]) / total
        if share > 0:
            parts.append(f"{lo if hi == lo else f'{lo}-{hi}'}:{100 * share:.0f}%")
        lo = hi + 1
    return " ".join(parts)


class Cell:
    """The runs of one method x setting."""

    def __init__(self, method: str, setting: str, runs: list[dict[str, Any]], expected_seeds: Sequence[int]):
        self.method, self.setting = method, setting
        self.finished = sorted((r for r in runs if r["status"] == "finished"), key=lambda r: r["seed"])
        # Diverged (non-finite loss or log-probs): an outcome, counted as a collapse by the claims, never dropped.
        self.diverged = sorted((r for r in runs if r["status"] == "diverged"), key=lambda r: r["seed"])
        self.failed = sorted((r for r in runs if r["status"] not in ("finished", "diverged")), key=lambda r: r["seed"])
        present = {r["seed"] for r in runs}
        self.missing = sorted(set(expected_seeds) - present)
        self.expected = len(set(expected_seeds) | present)

    def _runs(self, field: str) -> list[dict[str, Any]]:
        """Finished runs; for the eval-curve metrics also the diverged ones (zeros after the divergence)."""
        return [*self.finished, *self.diverged] if field in CURVE_FIELDS else self.finished

    def estimate(self, field: str) -> Estimate:
        return mean_interval([v for v in (_fraction_field(r, field) for r in self._runs(field)) if v is not None])

    def per_seed(self, field: str) -> dict[int, float]:
        """seed -> this field, for the finished runs that have it (for paired comparisons across cells)."""
        return {r["seed"]: v for r in self._runs(field) if (v := _fraction_field(r, field)) is not None}

    def value(self, field: str) -> str:
        if not self._runs(field):
            return "diverged" if self.diverged else "failed" if self.failed else "missing"
        return format_estimate(self.estimate(field), DIGITS.get(field, 3))

    def notes(self) -> str:
        out = []
        for r in self.diverged:
            out.append(f"seed {r['seed']} diverged at step {r.get('steps_done', '?')}")
        for r in self.failed:
            err = (r.get("error") or "no error recorded").splitlines()[0][:80].replace("|", "\\|")
            out.append(f"seed {r['seed']} failed ({err})")
        if self.missing:
            out.append("missing seed" + ("s " if len(self.missing) > 1 else " ") + ", ".join(map(str, self.missing)))
        capped = [r["seed"] for r in self.finished if (r.get("warm_start") or {}).get("target_reached") == 0.0]
        if capped:  # RL started from a weaker model than configured
            out.append("warm start hit its cap before its target: seed" + ("s " if len(capped) > 1 else " ")
                       + ", ".join(map(str, capped)))
        return "; ".join(out)

    def warm_start(self) -> Optional[str]:
        """The adaptive warm start's end point over seeds (None for fixed-step warm starts: no line)."""
        runs = [r for r in self.finished if _get(r, "warm_start.target_accuracy") is not None]
        if not runs:
            return None
        ws = [r["warm_start"] for r in runs]
        targets = "/".join(f"{t:g}" for t in sorted({w["target_accuracy"] for w in ws}))
        caps = "/".join(f"{c:.0f}" for c in sorted({w.get("cap", w["steps"]) for w in ws}))
        reached = sum(1 for w in ws if w.get("target_reached") == 1.0)
        steps = format_estimate(mean_interval([w["steps"] for w in ws]), 0)
        acc = format_estimate(mean_interval([w["accuracy"] for w in ws if "accuracy" in w]))
        per_seed = ", ".join(f"seed {r['seed']} {r['warm_start'].get('accuracy', float('nan')):.3f} at step "
                             f"{r['warm_start']['steps']:.0f}" for r in runs)
        return (f"target {targets} reached by {reached}/{len(runs)} seeds; steps {steps} (cap {caps}); held-out "
                f"greedy accuracy at the end {acc} ({per_seed})")

    def staleness(self) -> str:
        if not self.finished:
            return "-"
        hist: list[int] = []
        for r in self.finished:
            for lag, c in enumerate(r.get("staleness", {}).get("hist") or []):
                hist.extend([0] * (lag + 1 - len(hist)))
                hist[lag] += int(c)
        mx = max(int(r.get("staleness", {}).get("max") or 0) for r in self.finished)
        return f"max {mx}; {_hist_text(hist)}"


def group(summaries: Sequence[Mapping[str, Any]], *, method_keys: Sequence[str] = ("loss",),
          seeds: Optional[Sequence[int]] = None, methods: Optional[Sequence[str]] = None,
          settings: Optional[Sequence[str]] = None,
          grid: Optional[Sequence[Sequence[str]]] = None) -> list[Cell]:
    """Cells in (setting, method) order: every method x setting seen or expected, even with no run at all.
    ``grid`` ([method, setting] pairs, from a spec's ``setting_losses``): only these cells, e.g. one on-policy row."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for s in summaries:
        by[(method_label(s, method_keys), s["setting"])].append(dict(s))
    expected = sorted(set(seeds) if seeds else {s["seed"] for s in summaries})
    m_order = _order({m for m, _ in by}, methods)
    s_order = _order({st for _, st in by}, settings)
    keep = {tuple(x) for x in grid} if grid else None
    return [Cell(m, st, by.get((m, st), []), expected) for st in s_order for m in m_order
            if keep is None or (m, st) in keep or (m, st) in by]


# ------------------------------------------------------------------------------------------------ markdown
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def render_markdown(cells: Sequence[Cell], *, study: str, title: Optional[str] = None,
                    command: Optional[str] = None, regenerate: Optional[str] = None, wall_s: Optional[float] = None,
                    machine: Optional[Mapping[str, Any]] = None, figures: Sequence[str] = (),
                    method_keys: Sequence[str] = ("loss",), claims: Optional[Any] = None,
                    pilot: Optional[Mapping[str, Any]] = None) -> str:
    from stalerl_study.prereg import is_prereg, parse_claims

    claim_set = parse_claims(claims) if is_prereg(claims) else None
    main_columns = PREREG_COLUMNS if claim_set else MAIN_COLUMNS
    lines = [f"### {title or study}", ""]
    if command:
        lines += [f"Reproduce (runs the grid, collects the summaries, regenerates this block): `{command}`"]
    if regenerate:
        lines += [f"Regenerate this block from the committed summaries: `{regenerate}`"]
    if wall_s is not None or machine:
        m = machine or {}
        desc = ", ".join(str(x) for x in (m.get("cpu"), f"{m.get('cores')} cores" if m.get("cores") else None,
                                          f"torch {m.get('torch')}" if m.get("torch") else None,
                                          f"transformers {m.get('transformers')}" if m.get("transformers") else None)
                         if x)
        when = f"wall time of the table: {wall_s / 60:.1f} min" if wall_s is not None else ""
        lines += [f"{when}{' on ' if when and desc else ''}{desc}."]
    lines += ["", f"Cells: {INTERVAL_NOTE}. Seeds: finished/expected. Method = {', '.join(method_keys)}.", ""]
    if claim_set:
        from stalerl_study.prereg import render_paired_table

        lines += [*render_paired_table(cells, claim_set), ""]
    header = ["setting", "method", "seeds", *(h for h, _ in main_columns), "notes"]
    rows = [[c.setting, c.method, f"{len(c.finished)}/{c.expected}", *(c.value(f) for _, f in main_columns),
             c.notes() or "-"] for c in cells]
    lines += _table(header, rows)
    lines += ["", "Realised staleness (share of consumed samples per lag bin, all seeds) and token fractions:", ""]
    header = ["setting", "method", *(h for h, _ in DETAIL_COLUMNS[:1]), "staleness max; histogram",
              *(h for h, _ in DETAIL_COLUMNS[1:])]
    rows = [[c.setting, c.method, c.value(DETAIL_COLUMNS[0][1]), c.staleness(),
             *(c.value(f) for _, f in DETAIL_COLUMNS[1:])] for c in cells]
    lines += _table(header, rows)
    if any(_fraction_field(r, TRUST_REGION_COLUMNS[4][1]) is not None for c in cells for r in c.finished):
        lines += ["", "What the trust region removed: M2 over M2PO's trust-region tokens before and after masking, the "
                  "share of valid tokens M2PO masked, and on the same tokens the share PPO's clip at eps 0.2 would "
                  "have zeroed (actor/m2po/would_clip_fraction; the vanilla rows' own clip fraction beside them):",
                  ""]
        header = ["setting", "method", *(h for h, _ in TRUST_REGION_COLUMNS)]
        lines += _table(header, [[c.setting, c.method, *(c.value(f) for _, f in TRUST_REGION_COLUMNS)]
                                 for c in cells])
    ws = [(c, w) for c, w in ((c, c.warm_start()) for c in cells) if w]
    if len(ws) > 1 and len({w for _, w in ws}) == 1:  # one cached warm start per seed, shared by every row
        ws_lines = [f"every row (one warm start per seed, shared by all methods and settings): {ws[0][1]}"]
    else:
        ws_lines = [f"{c.setting}, {c.method}: {w}" for c, w in ws]
    if ws_lines:  # only for adaptive warm starts (warm_start.target_accuracy > 0): other blocks stay as they were
        lines += ["", "Adaptive warm start (stops at the first check whose greedy accuracy on held-out training "
                  "problems reaches the target; steps = its cap):", "", *(f"- {w}" for w in ws_lines)]
    if claim_set:
        from stalerl_study.prereg import render_prereg

        lines += ["", *render_prereg(cells, claim_set)]
    elif claims:
        from stalerl_study.claims import render_claims

        lines += ["", *render_claims(cells, claims)]
    if pilot is not None:  # the pilot's decision rule (stalerl_study.pilot), on the stale loss and on-policy runs only
        from stalerl_study.pilot import render_pilot

        lines += ["", "Pilot decision (rule fixed in the spec before the runs; only the stale loss and the on-policy "
                  "runs are read):", "", render_pilot(cells, pilot)]
    if claim_set or pilot is not None:
        lines += ["", *render_diagnostics(cells)]
        quadrants = render_quadrants(cells)
        if quadrants:  # only runs that logged them (issue 30): older blocks stay byte for byte as they were
            lines += ["", *quadrants]
        for extra in (render_by_lag(cells), render_mismatch(cells)):  # likewise (issue 47's summary fields)
            if extra:
                lines += ["", *extra]
    for fig in figures:
        lines += ["", f"![{study}: {Path(fig).stem}]({fig})"]
    return "\n".join(lines) + "\n"


# Drift diagnostics (summary schema 2): (header, metric, statistic over steps). Runs without them show "-".
DIAGNOSTIC_COLUMNS = (
    ("M2 before masking (mean)", "actor/m2po/m2_before", "mean"),
    ("M2 all tokens (mean)", "actor/m2_all_tokens", "mean"),
    ("\\|log-ratio\\| max (max)", "actor/log_ratio_abs_max", "max"),  # escaped: a table cell
    ("ratio max (max)", "actor/ratio_max", "max"),
    ("entropy (mean)", "rollout/entropy", "mean"),
)


def render_diagnostics(cells: Sequence[Cell]) -> list[str]:
    """Per cell, the mean over runs of each diagnostic's per-run mean or max over steps."""
    rows = []
    for c in cells:
        runs = [*c.finished, *c.diverged]
        row = [c.setting, c.method]
        for _, key, stat in DIAGNOSTIC_COLUMNS:
            vals = [float(v) for r in runs
                    if isinstance(v := ((r.get("diagnostics") or {}).get(key) or {}).get(stat), (int, float))]
            row.append(format_estimate(mean_interval(vals), 4) if vals else "-")
        gn = [float(v) for r in runs if isinstance(v := (r.get("grad_norm") or {}).get("max"), (int, float))]
        row.append(format_estimate(mean_interval(gn), 3) if gn else "-")
        rows.append(row)
    header = ["setting", "method", *(h for h, _, _ in DIAGNOSTIC_COLUMNS), "grad norm before clipping (max)"]
    return ["Drift diagnostics (per run: mean or max over steps; cells: mean over runs ± 95% half-width; curves in "
            "the summaries):", "", *_table(header, rows)]


# Which tokens each trust region removes, per quadrant: (loss prefix, noun). Summaries written before these metrics
# existed have none, and a block whose runs all lack them has no such table.
QUADRANT_LOSSES = (("m2po", "masked"), ("vanilla", "clipped"), ("m2po_authors", "clipped"))
QUADRANT_NAMES = (("pos_r_gt_1", "A>0, r>1"), ("neg_r_lt_1", "A<0, r<1"))


def render_quadrants(cells: Sequence[Cell]) -> list[str]:
    """Per cell, the mean over runs of the per-run mean over steps of the removed tokens per quadrant and their share
    of the trust region's gradient weight |A r|."""
    rows = []
    for c in cells:
        runs = [*c.finished, *c.diverged]
        for loss, noun in QUADRANT_LOSSES:
            keys = [f"actor/{loss}/{what}_{q}" for q, _ in QUADRANT_NAMES for what in (f"num_{noun}",
                                                                                       f"{noun}_weight_share")]
            per_key = [[float(v) for r in runs
                        if isinstance(v := ((r.get("diagnostics") or {}).get(k) or {}).get("mean"), (int, float))]
                       for k in keys]
            if not any(per_key):
                continue
            rows.append([c.setting, c.method, f"{loss} {noun}",
                         *(format_estimate(mean_interval(v), 2 if i % 2 == 0 else 4) if v else "-"
                           for i, v in enumerate(per_key))])
    if not rows:
        return []
    header = ["setting", "method", "tokens"]
    for _, name in QUADRANT_NAMES:
        header += [f"removed per step ({name})", f"share of trust-region \\|A·r\\| ({name})"]
    return ["Removed tokens by trust-region quadrant (per run: mean over steps; cells: mean over runs ± 95% "
            "half-width). Share: the removed tokens' gradient weight \\|A·r\\| over that of all trust-region "
            "tokens:", "", *_table(header, rows)]


# Diagnostics by lag (summary field ``by_lag``, issue 47): which metrics, and at which lags, the table shows.
BY_LAG_METRICS = (("M2 before masking", "actor/m2po/m2_before"), ("M2PO masked", "actor/m2po/masked_fraction"),
                  ("clip would zero (M2PO's tokens)", "actor/m2po/would_clip_fraction"),
                  ("clip zeroed", "actor/vanilla/clip_fraction"), ("authors' clip", "actor/m2po_authors/clip_fraction"),
                  ("DPPO (TV) masked", "actor/dppo_tv/masked_fraction"))


def _span(counts: Sequence[int]) -> str:
    """'n' when every run has the same count, 'lo-hi' when they differ, '-' when none."""
    if not counts:
        return "-"
    return str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"


def _table_lags(lags: Sequence[int]) -> list[int]:
    """0, 1, 2, 4, ... up to the largest lag, and the largest lag itself (a run's full lag)."""
    top = max(lags)
    picked = [x for x in (0, *(2 ** i for i in range(top.bit_length()))) if x in lags]
    return sorted({*picked, top})


def render_by_lag(cells: Sequence[Cell]) -> list[str]:
    """Per cell and diagnostic, the mean over runs of the diagnostic's mean over the steps whose samples were all
    that many versions old (the summaries' ``by_lag``); [] when no run records more than one lag."""
    per_cell = [(c, [r.get("by_lag") or {} for r in (*c.finished, *c.diverged)]) for c in cells]
    lags = sorted({int(k) for _, bl in per_cell for b in bl for k in b})
    if len(lags) < 2:
        return []
    shown = _table_lags(lags)
    rows = []
    for c, bl in per_cell:
        for name, key in BY_LAG_METRICS:
            vals = [[float(v) for b in bl if isinstance(v := (b.get(str(lag)) or {}).get(key), (int, float))]
                    for lag in shown]
            if any(vals):
                rows.append([c.setting, c.method, name, *(format_estimate(mean_interval(v), 4) if v else "-"
                                                          for v in vals)])
    if not rows:
        return []
    steps = [[int(b[str(lag)]["steps"]) for _, bl in per_cell for b in bl if str(lag) in b] for lag in shown]
    per_run = ", ".join(f"lag {lag}: {_span(n)}" for lag, n in zip(shown, steps) if n)
    header = ["setting", "method", "diagnostic", *(f"lag {lag}" for lag in shown)]
    return [f"Diagnostics by lag (per run: the mean over the steps whose samples were all that many versions old; "
            f"cells: mean over runs ± 95% half-width; steps per run: {per_run}):", "", *_table(header, rows)]


MISMATCH_COLUMNS = (("M2 of the mismatch (mean)", "mismatch/m2", "mean"),
                    ("\\|d\\| mean (mean)", "mismatch/abs_mean", "mean"),
                    ("\\|d\\| max (max)", "mismatch/max_abs", "max"),
                    ("mean d (mean)", "mismatch/mean", "mean"))


def render_mismatch(cells: Sequence[Cell]) -> list[str]:
    """Per cell, the engine-vs-trainer mismatch on fresh data (summaries' ``mismatch``; d = trainer log-prob - engine
    log-prob per token): mean over runs of each probe statistic; [] when no run probed."""
    rows = []
    for c in cells:
        runs = [r.get("mismatch") or {} for r in (*c.finished, *c.diverged)]
        if not any(runs):
            continue
        row = [c.setting, c.method]
        for _, key, stat in MISMATCH_COLUMNS:
            vals = [float(v) for m in runs if isinstance(v := (m.get(key) or {}).get(stat), (int, float))]
            row.append(f"{mean_interval(vals).mean:.3g}" if vals else "-")
        probes = [int(v) for m in runs if isinstance(v := (m.get("mismatch/m2") or {}).get("n"), int)]
        row.append(_span(probes))
        rows.append(row)
    if not rows:
        return []
    header = ["setting", "method", *(h for h, _, _ in MISMATCH_COLUMNS), "probes per run"]
    return ["Engine vs trainer on fresh data (stats_logger.mismatch_freq_steps; d = trainer log-prob - engine "
            "log-prob per sampled token; cells: mean over runs; M2PO's τ is 0.04):", "", *_table(header, rows)]


# ------------------------------------------------------------------------------------------------ figures
def _curve(summary: Mapping[str, Any], metric: str) -> list[tuple[float, float]]:
    return [(float(s), float(v)) for s, v in (summary.get("curves") or {}).get(metric, [])]


def mean_band(curves: Sequence[Sequence[tuple[float, float]]]) -> tuple[list[float], list[Estimate]]:
    """Curves interpolated onto the steps of the shortest one (up to the smallest last step); per-step estimate."""
    import numpy as np

    curves = [c for c in curves if c]
    if not curves:
        return [], []
    base = min(curves, key=len)
    end = min(c[-1][0] for c in curves)
    xs = [x for x, _ in base if x <= end]
    ys = [np.interp(xs, [x for x, _ in c], [y for _, y in c]) for c in curves]
    return xs, [mean_interval([float(y[i]) for y in ys]) for i in range(len(xs))]


def figure_paths(cells: Sequence[Cell], out_dir: Path, *, study: str,
                 metrics: Sequence[str] = FIGURE_METRICS) -> dict[str, Path]:
    """metric -> PNG path, for the metrics some finished run has a curve of (what the markdown links to)."""
    return {m: out_dir / f"{study}_{m.replace('/', '_')}.png" for m in metrics
            if any(_curve(r, m) for c in cells for r in c.finished)}


#: One colour per built-in loss, so a loss looks the same in every study's figures.
LOSS_COLORS = {"m2po": "C0", "vanilla": "C1", "no_trust_region": "C2", "fipo": "C3"}


def method_colors(methods: Sequence[str]) -> dict[str, str]:
    """Matplotlib colours: the fixed loss colour when every method is a built-in loss, else by position."""
    if all(m in LOSS_COLORS for m in methods):
        return {m: LOSS_COLORS[m] for m in methods}
    return {m: f"C{j}" for j, m in enumerate(methods)}


def write_figures(cells: Sequence[Cell], out_dir: Path, *, study: str,
                  metrics: Sequence[str] = FIGURE_METRICS) -> list[Path]:
    """One PNG per metric: a subplot per setting, per method the mean curve over seeds with its 95% band."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError('stalerl-report figures need matplotlib: pip install "stalerl[plot]" '
                          "(or pass --no-figures)") from exc
    settings = list(dict.fromkeys(c.setting for c in cells))
    methods = list(dict.fromkeys(c.method for c in cells))
    colors = method_colors(methods)
    out = []
    for metric, path in figure_paths(cells, out_dir, study=study, metrics=metrics).items():
        ncol = min(len(settings), 4)
        nrow = math.ceil(len(settings) / ncol)
        # One setting alone still gets a figure wide enough for the long metric names in its titles
        fig = Figure(figsize=(max(4 * ncol, 6.4), 3 * nrow), dpi=100)
        FigureCanvasAgg(fig)
        for i, setting in enumerate(settings):
            ax = fig.add_subplot(nrow, ncol, i + 1)
            for method in methods:
                cell = next((c for c in cells if c.setting == setting and c.method == method), None)
                if cell is None:
                    continue
                xs, est = mean_band([_curve(r, metric) for r in cell.finished])
                if not xs:
                    continue
                color = colors[method]
                ax.plot(xs, [e.mean for e in est], color=color, label=f"{method} (n={len(cell.finished)})")
                if all(e.half_width is not None for e in est):
                    ax.fill_between(xs, [e.low for e in est], [e.high for e in est], color=color, alpha=0.2,
                                    linewidth=0)
            ax.set_title(setting, fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel(metric if len(metric) <= 28 else metric.rsplit("/", 1)[-1], fontsize=8)
            ax.legend(fontsize=7)
        fig.suptitle(textwrap.fill(f"{study}: {metric} (mean, 95% t-band over seeds)", 11 * max(4 * ncol, 6.4)),
                     fontsize=10)
        fig.tight_layout()
        buf = __import__("io").BytesIO()
        # No Software/date metadata: the same matplotlib version writes the same bytes.
        fig.savefig(buf, format="png", metadata={"Software": None})
        atomic_write_bytes(path, buf.getvalue())
        out.append(path)
    return out


# ------------------------------------------------------------------------------------------------ doc markers
def markers(study: str) -> tuple[str, str]:
    return f"<!-- results:begin {study} -->", f"<!-- results:end {study} -->"


def replace_block(text: str, study: str, block: str) -> str:
    begin, end = markers(study)
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ReportError(f"the document has no '{begin}' ... '{end}' pair; add both lines where the {study} "
                          "results belong, then rerun")
    return text[:i + len(begin)] + "\n" + block + text[j:]


# ------------------------------------------------------------------------------------------------ command
def default_figure_dir(paths: Sequence[os.PathLike]) -> Path:
    """Where figures go without ``--out``: a study's collected results directory (it holds study.json; its document
    links the figures there), else the current directory, so a run directory is never written into unasked."""
    first = Path(paths[0])
    if first.is_dir() and (first / STUDY_FILE).is_file():
        return first
    return Path.cwd()


def build(paths: Sequence[os.PathLike], *, study: Optional[str] = None, title: Optional[str] = None,
          method_keys: Optional[Sequence[str]] = None, seeds: Optional[Sequence[int]] = None,
          out_dir: Optional[os.PathLike] = None, doc: Optional[os.PathLike] = None, figures: bool = True,
          ) -> tuple[str, list[Path]]:
    """(markdown block, figure paths written). Figures go to ``out_dir`` (default: :func:`default_figure_dir`)."""
    meta = load_study(paths)
    summaries = load_summaries(paths)
    if not summaries:
        raise ReportError(f"no run summaries ({SUMMARY_FILE} or collected *.json) under {', '.join(map(str, paths))}")
    study = study or meta.get("name") or "study"
    method_keys = list(method_keys or meta.get("method_keys") or ["loss"])
    cells = group(summaries, method_keys=method_keys, seeds=seeds or meta.get("seeds"), methods=meta.get("methods"),
                  settings=meta.get("settings"), grid=meta.get("grid"))
    out = Path(out_dir) if out_dir else default_figure_dir(paths)
    metrics = meta.get("figure_metrics") or FIGURE_METRICS
    fig_paths: list[Path] = []
    if figures:
        out.mkdir(parents=True, exist_ok=True)
        fig_paths = write_figures(cells, out, study=study, metrics=metrics)
    base = Path(doc).parent if doc else out
    # Linked whether or not they are (re)drawn now: --check compares the markdown only.
    links = [Path(os.path.relpath(p, base)).as_posix()
             for p in figure_paths(cells, out, study=study, metrics=metrics).values()]
    regenerate = meta.get("regenerate")
    block = render_markdown(cells, study=study, title=title or meta.get("title"), command=meta.get("command"),
                            regenerate=regenerate, wall_s=meta.get("wall_s"), machine=meta.get("machine"),
                            figures=links, method_keys=method_keys, claims=meta.get("claims"),
                            pilot=meta.get("pilot"))
    return block, fig_paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="stalerl-report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="run directories, directories of summaries, or summary files")
    p.add_argument("--study", help="study name (default: from study.json, else 'study')")
    p.add_argument("--title", help="table title")
    p.add_argument("--method-keys", help="comma-separated summary fields naming a method (default: loss)")
    p.add_argument("--seeds", help="expected seeds, comma-separated (default: from study.json, else those seen)")
    p.add_argument("--out", help="directory for <study>.md and the figures (default for the figures: a study's "
                                 "results directory when the first input is one (it holds study.json), else the "
                                 "current directory; a run directory is never written into unasked)")
    p.add_argument("--update-doc", metavar="FILE", help="replace the study's results block in FILE")
    p.add_argument("--check", action="store_true", help="with --update-doc: exit 1 if FILE is not up to date")
    p.add_argument("--no-figures", action="store_true", help="tables only")
    a = p.parse_args(argv)
    try:
        block, figs = build(a.paths, study=a.study, title=a.title,
                            method_keys=a.method_keys.split(",") if a.method_keys else None,
                            seeds=[int(s) for s in a.seeds.split(",")] if a.seeds else None, out_dir=a.out,
                            doc=a.update_doc, figures=not (a.no_figures or a.check))
        study = a.study or load_study(a.paths).get("name") or "study"
        if a.update_doc:
            doc = Path(a.update_doc)
            old = doc.read_text()
            new = replace_block(old, study, block)
            if a.check:
                if new != old:
                    print(f"{doc}: the {study} results block is out of date; rerun without --check", file=sys.stderr)
                    return 1
                print(f"{doc}: the {study} results block is up to date")
                return 0
            if new != old:
                atomic_write_text(doc, new)
            print(f"{doc}: {study} results block {'updated' if new != old else 'unchanged'}")
        else:
            out = Path(a.out) if a.out else None
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out / f"{study}.md", block)
            print(block)
        for f in figs:
            print(f"figure: {f}")
    except (ReportError, FileNotFoundError, ValueError) as exc:
        print(f"stalerl-report: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

