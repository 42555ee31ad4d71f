"""Pre-registered claims: listed in the study spec before the grid runs, tested with statistics that can say no.

A spec's ``claims`` mapping (copied into ``study.json``; see examples/math/study/chain_*.yaml)::

    claims:
      alpha: 0.025                     # one-sided level of every claim, family-wise over the study after Holm
      baseline: vanilla @ fixed_staleness 0        # the on-policy cell of the paired table (shown once)
      collapse: {after_step: 100, drop: 0.1, consecutive: 2, early_end: 150, final_evals: 3}
      list:
        - {id: clip-degrades, text: ..., test: less, a: vanilla @ fixed_staleness 16,
           b: vanilla @ fixed_staleness 0, metric: last3}
        - {id: m2po-tracks, test: equivalent, margin: 0.05, a: ..., b: ..., metric: auc}
        - {id: ntr-collapses, test: collapses_more, a: no_trust_region @ fixed_staleness 16, b: ...}

Cells are named ``method @ setting`` (method as the report labels it, setting as the run reports it). Tests, on
runs that finished or diverged (a diverged run counts with accuracy 0 after it stopped, and as collapsed; see
:mod:`stalerl_study.metrics`):

- ``greater`` / ``less``: paired by seed (a seed fixes the initial weights, warm start and data order), one-sided
  one-sample t-test of ``metric(a) - metric_b(b)`` against 0.
- ``equivalent``: two one-sided tests (TOST) that the paired mean difference lies within ``(-margin, +margin)``;
  an interval that merely contains 0 is *not* support.
- ``noninferior``: a is not worse than b by ``margin`` or more: the one-sided paired t-test of H0 mean <= -margin;
  the opposite (does not hold) is that a is worse by more than the margin (mean < -margin significantly).
- ``collapses_more``: the pre-registered collapse rule per run, then a one-sided Fisher exact test that ``a``
  collapses more often than ``b`` (counts, not paired). The paired early-peak-to-final drop is shown beside it.

Power, stated at registration: a claim may give ``expected_sd``, the SD of the paired differences it expects (from a
pilot or an earlier study; say where in a comment), for its metric. ``stalerl-study`` then prints, before anything
runs, each claim's minimum detectable effect (one-sided tests) or its expected interval half-width and its power at a
true difference of 0 (equivalence) at the planned seeds, and refuses to run an equivalence claim whose power there
is below 0.8, or that states no ``expected_sd``, unless the claim says ``accept_low_power: <why>`` (see
:func:`power_report`).

``claims.power: holm`` asks more of a registration: every primary claim must reach power 0.8 at Holm's strictest
level, alpha / (the number of primary claims): a ``greater``/``less`` claim at its stated ``effect`` (the smallest true
difference the study is sized for), a margin claim at a true difference of 0; a claim that does not is refused
unless it says ``accept_low_power``. A claim marked ``secondary: true`` is tested and shown in its own table,
Holm-adjusted among the secondary claims only, so it neither dilutes the primary family nor needs power.

Beside each paired test's p the block shows an exact sign-flip (permutation) p, with its own Holm adjustment: a
secondary column; the verdict is always the registered test's.

The p-values of a study's claims are Holm-adjusted together. Verdicts: **holds** (adjusted p <= alpha),
**does not hold** (the test of the opposite, also Holm-adjusted across the study's claims, is significant: a < b
for ``greater``, |difference| >= margin for ``equivalent``, b collapses more for ``collapses_more``), **not shown**
(neither; includes claims with fewer than two paired seeds). tests/unit/test_report_prereg.py simulates null
studies and checks each claim's false "holds" rate against alpha.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from stalerl.core.errors import refuse_unknown_keys
from stalerl_study.metrics import EVAL_METRICS, OUTCOME_STATUSES, CollapseRule, collapsed, run_metric
from stalerl_study.stats import (equivalence_margin_needed, fisher_greater, format_estimate, holm_adjust,
                                 mean_interval, minimum_detectable_effect, paired_test, power_equivalence,
                                 power_one_sided, sign_flip_equivalence_p, sign_flip_p, t_quantile)

TESTS = ("greater", "less", "equivalent", "noninferior", "collapses_more")
MARGIN_TESTS = ("equivalent", "noninferior")
CLAIM_KEYS = {"id", "text", "test", "a", "b", "metric", "metric_b", "margin", "expected_sd", "accept_low_power",
              "effect", "secondary"}
POWER_LEVELS = ("alpha", "holm")  # claims.power: the level a claim's power is checked at (see power_report)
POWER_TARGET = 0.8  # an equivalence claim below this power at a true difference of 0 is refused unless accepted
METRIC_NAMES = {"last3": "mean of last 3 evals", "auc": "eval-curve AUC", "final": "final eval",
                "peak_drop": "early peak - final window"}


class ClaimSpecError(ValueError):
    pass


def parse_cell(text: Any, where: str) -> tuple[str, str]:
    if not isinstance(text, str) or " @ " not in text:
        raise ClaimSpecError(f"{where}={text!r}: expected 'method @ setting', e.g. 'm2po @ fixed_staleness 16'")
    method, setting = (x.strip() for x in text.split(" @ ", 1))
    return method, setting


@dataclass(frozen=True)
class Claim:
    id: str
    text: str
    test: str
    a: tuple[str, str]
    b: tuple[str, str]
    metric: str = "last3"
    metric_b: Optional[str] = None
    margin: Optional[float] = None
    expected_sd: Optional[float] = None  # the SD of the paired differences the registration expects
    accept_low_power: Optional[str] = None  # why an underpowered equivalence claim runs anyway
    effect: Optional[float] = None  # greater/less: the smallest true difference the registration is powered for
    secondary: bool = False  # Holm-adjusted within the secondary claims only; never part of the primary family


@dataclass(frozen=True)
class ClaimSet:
    claims: tuple[Claim, ...]
    alpha: float = 0.025
    baseline: Optional[tuple[str, str]] = None
    rule: CollapseRule = field(default_factory=CollapseRule)
    power: str = "alpha"  # "holm": every primary claim needs power >= POWER_TARGET at alpha / (primary claims)

    @property
    def primary(self) -> tuple[Claim, ...]:
        return tuple(c for c in self.claims if not c.secondary)


def parse_claims(spec: Mapping[str, Any], where: str = "claims") -> ClaimSet:
    """Validate a spec's ``claims`` mapping; every problem is one line naming the key and the fix."""
    if not isinstance(spec, Mapping):
        raise ClaimSpecError(f"{where}: expected a mapping with 'list' (and alpha, baseline, collapse)")
    unknown = set(spec) - {"alpha", "baseline", "collapse", "list", "power"}
    if unknown:
        raise ClaimSpecError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected alpha, baseline, "
                             "collapse, list, power")
    power = spec.get("power", "alpha")
    if power not in POWER_LEVELS:
        raise ClaimSpecError(f"{where}.power={power!r}: expected 'alpha' (power checked at each claim's level) or "
                             "'holm' (every primary claim powered at alpha / the number of primary claims)")
    alpha = spec.get("alpha", 0.025)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 0.5:
        raise ClaimSpecError(f"{where}.alpha={alpha!r}: expected a one-sided level in (0, 0.5), e.g. 0.025")
    baseline = parse_cell(spec["baseline"], f"{where}.baseline") if spec.get("baseline") is not None else None
    try:
        rule = CollapseRule.from_spec(spec.get("collapse"), f"{where}.collapse")
    except (TypeError, ValueError) as exc:
        raise ClaimSpecError(str(exc)) from exc
    items = spec.get("list")
    if not isinstance(items, list) or not items:
        raise ClaimSpecError(f"{where}.list: expected a non-empty list of claims (id, text, test, a, b, metric)")
    claims, seen = [], set()
    for i, c in enumerate(items):
        w = f"{where}.list[{i}]"
        if not isinstance(c, Mapping):
            raise ClaimSpecError(f"{w}: expected a mapping with id, text, test, a, b")
        refuse_unknown_keys(w, c, CLAIM_KEYS, ClaimSpecError)
        for key in ("id", "text", "test", "a", "b"):
            if not c.get(key):
                raise ClaimSpecError(f"{w}.{key} is required")
        if c["id"] in seen:
            raise ClaimSpecError(f"{w}.id={c['id']!r} is used twice; give every claim its own id")
        seen.add(c["id"])
        if c["test"] not in TESTS:
            raise ClaimSpecError(f"{w}.test={c['test']!r}: expected one of {', '.join(TESTS)}")
        metric = c.get("metric", "last3")
        for key in ("metric", "metric_b"):
            m = c.get(key)
            if m is not None and (not isinstance(m, str) or not m):
                raise ClaimSpecError(f"{w}.{key}={m!r}: expected {', '.join(EVAL_METRICS)} or a summary field path")
        margin = c.get("margin")
        if c["test"] in MARGIN_TESTS:
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0:
                kind = "an equivalence" if c["test"] == "equivalent" else "a non-inferiority"
                raise ClaimSpecError(f"{w}.margin={margin!r}: {kind} claim needs a margin > 0, e.g. 0.05")
        elif margin is not None:
            raise ClaimSpecError(f"{w}.margin: only 'equivalent' and 'noninferior' claims take a margin; remove it")
        sd = c.get("expected_sd")
        if sd is not None:
            if isinstance(sd, bool) or not isinstance(sd, (int, float)) or not sd > 0:
                raise ClaimSpecError(f"{w}.expected_sd={sd!r}: expected the SD of the paired differences, a number > 0 "
                                     "(e.g. 0.03, from a pilot's or an earlier study's summaries)")
            if c["test"] == "collapses_more":
                raise ClaimSpecError(f"{w}.expected_sd: a collapses_more claim counts collapses (Fisher), it has no "
                                     "paired SD; remove it")
        effect = c.get("effect")
        if effect is not None:
            if c["test"] not in ("greater", "less"):
                raise ClaimSpecError(f"{w}.effect: only 'greater' and 'less' claims take an effect (the smallest true "
                                     "difference they are powered for); a margin claim is powered at a difference of "
                                     "0; remove it")
            if isinstance(effect, bool) or not isinstance(effect, (int, float)) or not effect > 0:
                raise ClaimSpecError(f"{w}.effect={effect!r}: expected the smallest true difference the claim is "
                                     "powered for, a number > 0 in the claimed direction (e.g. 0.1)")
        secondary = c.get("secondary", False)
        if not isinstance(secondary, bool):
            raise ClaimSpecError(f"{w}.secondary={secondary!r}: expected true or false")
        accept = c.get("accept_low_power")
        if accept is not None and (not isinstance(accept, str) or not accept.strip()):
            raise ClaimSpecError(f"{w}.accept_low_power={accept!r}: expected a sentence saying why the claim runs "
                                 "although it is underpowered")
        claims.append(Claim(id=str(c["id"]), text=str(c["text"]), test=c["test"], a=parse_cell(c["a"], f"{w}.a"),
                            b=parse_cell(c["b"], f"{w}.b"), metric=metric, metric_b=c.get("metric_b"),
                            margin=None if margin is None else float(margin),
                            expected_sd=None if sd is None else float(sd), accept_low_power=accept,
                            effect=None if effect is None else float(effect), secondary=secondary))
    if not any(not c.secondary for c in claims):
        raise ClaimSpecError(f"{where}.list: every claim is secondary; a study registers at least one primary claim")
    return ClaimSet(tuple(claims), float(alpha), baseline, rule, power)


# ------------------------------------------------------------------------------------------------ evaluation
def outcome_runs(cells: Sequence[Any], cell: tuple[str, str]) -> list[Mapping[str, Any]]:
    """The runs of ``method @ setting`` whose numbers are outcomes (finished or diverged), in seed order."""
    for c in cells:
        if (c.method, c.setting) == cell:
            return sorted((r for r in (*c.finished, *getattr(c, "diverged", []))
                           if r.get("status") in OUTCOME_STATUSES), key=lambda r: r["seed"])
    return []


def paired_values(cells, a: tuple[str, str], b: tuple[str, str], metric: str, metric_b: Optional[str],
                  rule: CollapseRule) -> list[tuple[int, float, float]]:
    """(seed, a's value, b's value) for every seed both cells have, in seed order."""
    av = {r["seed"]: v for r in outcome_runs(cells, a) if (v := run_metric(r, metric, rule)) is not None}
    bv = {r["seed"]: v for r in outcome_runs(cells, b) if (v := run_metric(r, metric_b or metric, rule)) is not None}
    return [(s, av[s], bv[s]) for s in sorted(set(av) & set(bv))]


@dataclass(frozen=True)
class Result:
    claim: Claim
    p: Optional[float]  # the claim's one-sided p-value (TOST for equivalence, Fisher for collapse)
    p_against: Optional[float]  # the opposite's
    evidence: str
    p_adj: Optional[float] = None
    p_against_adj: Optional[float] = None
    verdict: str = "not shown"
    p_perm: Optional[float] = None  # the exact sign-flip p of the same claim (secondary; None for Fisher claims)
    p_perm_adj: Optional[float] = None


def _sign(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}"


def test_claim(cells, claim: Claim, rule: CollapseRule, alpha: float) -> Result:
    if claim.test == "collapses_more":
        ra, rb = outcome_runs(cells, claim.a), outcome_runs(cells, claim.b)
        ca = [x for x in (collapsed(r, rule) for r in ra) if x is not None]
        cb = [x for x in (collapsed(r, rule) for r in rb) if x is not None]
        if not ca or not cb:
            return Result(claim, None, None, "no runs")
        ka, kb = sum(ca), sum(cb)
        pairs = paired_values(cells, claim.a, claim.b, "peak_drop", None, rule)
        drop = mean_interval([x - y for _, x, y in pairs])
        ev = (f"collapsed {ka}/{len(ca)} vs {kb}/{len(cb)}; paired early-peak-to-final drop difference "
              f"{format_estimate(drop)}")
        return Result(claim, fisher_greater(ka, len(ca), kb, len(cb)), fisher_greater(kb, len(cb), ka, len(ca)), ev)
    pairs = paired_values(cells, claim.a, claim.b, claim.metric, claim.metric_b, rule)
    t = paired_test([x - y for _, x, y in pairs])
    if t.se is None:
        return Result(claim, None, None, f"{t.n} paired seed(s)")
    wins = sum(x > y for _, x, y in pairs)
    digits = 4 if claim.metric.startswith(("fractions.", "by_lag.", "mismatch.")) else 3  # shares and small M2s
    est = mean_interval([x - y for _, x, y in pairs])
    ev = f"difference {format_estimate(est, digits)}, a higher in {wins}/{t.n} seeds"
    diffs = [x - y for _, x, y in pairs]
    if claim.test == "greater":
        return Result(claim, t.p_greater(), t.p_less(), ev, p_perm=sign_flip_p(diffs, "greater"))
    if claim.test == "less":
        return Result(claim, t.p_less(), t.p_greater(), ev, p_perm=sign_flip_p(diffs, "less"))
    if claim.test == "noninferior":
        lo = est.mean - (t_quantile(1.0 - alpha, t.df) * t.se)
        ev += f"; one-sided {100 * (1 - alpha):g}% lower bound {_sign(lo)} vs -{claim.margin:g}"
        return Result(claim, t.p_greater(-claim.margin), t.p_less(-claim.margin), ev,
                      p_perm=sign_flip_p(diffs, "greater", -claim.margin))
    lo, hi = t.interval(alpha)
    ev += f"; {100 * (1 - 2 * alpha):g}% interval [{_sign(lo)}, {_sign(hi)}] vs margin ±{claim.margin:g}"
    return Result(claim, t.p_equivalent(claim.margin),
                  min(t.p_greater(claim.margin), t.p_less(-claim.margin)), ev,
                  p_perm=sign_flip_equivalence_p(diffs, claim.margin))


def _holm_by_family(raw: Sequence[Result], values: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Holm-adjust the primary claims' p-values together and the secondary claims' together (in claim order)."""
    out: list[Optional[float]] = [None] * len(raw)
    for secondary in (False, True):
        idx = [i for i, r in enumerate(raw) if r.claim.secondary == secondary]
        for i, p in zip(idx, holm_adjust([values[i] for i in idx])):
            out[i] = p
    return out


def evaluate(cells, claim_set: ClaimSet) -> list[Result]:
    """Every claim tested, Holm-adjusted within its family (the primary claims together, the secondary ones
    together; claims and their opposites as separate families)."""
    raw = [test_claim(cells, c, claim_set.rule, claim_set.alpha) for c in claim_set.claims]
    adj = _holm_by_family(raw, [r.p for r in raw])
    adj_against = _holm_by_family(raw, [r.p_against for r in raw])
    adj_perm = _holm_by_family(raw, [r.p_perm for r in raw])  # a second view: never decides a verdict
    out = []
    for r, p, q, pp in zip(raw, adj, adj_against, adj_perm):
        verdict = "not shown"
        if p is not None and p <= claim_set.alpha:
            verdict = "holds"
        elif q is not None and q <= claim_set.alpha:
            verdict = "does not hold"
        out.append(Result(r.claim, r.p, r.p_against, r.evidence, p, q, verdict, r.p_perm, pp))
    return out


def _p(p: Optional[float]) -> str:
    if p is None:
        return "-"
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def _cell_name(c: tuple[str, str]) -> str:
    return f"{c[0]} @ {c[1]}"


def _what(claim: Claim) -> str:
    metric = METRIC_NAMES.get(claim.metric, claim.metric)
    if claim.metric_b:
        metric += f" vs {METRIC_NAMES.get(claim.metric_b, claim.metric_b)}"
    if claim.test == "collapses_more":
        return f"{_cell_name(claim.a)} collapses more often than {_cell_name(claim.b)} (Fisher exact)"
    rel = {"greater": ">", "less": "<", "equivalent": "≈", "noninferior": "not below"}[claim.test]
    if claim.test == "equivalent":
        extra = f" within ±{claim.margin:g} (TOST)"
    elif claim.test == "noninferior":
        extra = f" by {claim.margin:g} or more (non-inferiority, paired t)"
    else:
        extra = " (paired t)"
    return f"{_cell_name(claim.a)} {rel} {_cell_name(claim.b)}: {metric}{extra}"


def render_prereg(cells, claim_set: ClaimSet) -> list[str]:
    results = evaluate(cells, claim_set)
    primary = [x for x in results if not x.claim.secondary]
    secondary = [x for x in results if x.claim.secondary]
    r = claim_set.rule
    family = (f"Holm-adjusted across the study's {len(results)} claims" if not secondary else
              f"Holm-adjusted across the study's {len(primary)} primary claims (the {len(secondary)} secondary "
              "claims below are adjusted among themselves and never enter the primary family)")
    lines = [f"Pre-registered claims (listed in the study spec before the runs; one-sided level α = "
             f"{claim_set.alpha:g} per claim, {family}; paired by "
             "seed; a diverged run counts with accuracy 0 after it stopped and as collapsed). Collapse: the eval "
             f"falls ≥ {r.drop:g} below the run's running best for {r.consecutive} consecutive evals at steps ≥ "
             f"{r.after_step}, or the run diverged; early-peak-to-final drop: the best eval at steps ≤ {r.early_end} "
             f"minus the mean of the last {r.final_evals}. Holds: adjusted p ≤ α; does not hold: the opposite is "
             "significant after adjustment; not shown: neither. Secondary, never the verdict: the exact sign-flip "
             "(permutation) p of the same paired comparison (all 2^n sign patterns of the differences; its floor "
             "is 1/2^n) and its Holm-adjusted value.", ""]
    lines += _claim_table(primary)
    if secondary:
        lines += ["", f"Secondary claims (registered with the primary ones; Holm-adjusted across these "
                      f"{len(secondary)} only):", "", *_claim_table(secondary)]
    return lines


def _claim_table(results: Sequence[Result]) -> list[str]:
    lines = ["| claim | test | evidence | p | Holm p | sign-flip p (Holm) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for x in results:
        perm = "-" if x.p_perm is None else f"{_p(x.p_perm)} ({_p(x.p_perm_adj)})"
        lines.append(f"| {x.claim.id}: {x.claim.text} | {_what(x.claim)} | {x.evidence} | {_p(x.p)} | "
                     f"{_p(x.p_adj)} | {perm} | **{x.verdict}** |")
    return lines


# ------------------------------------------------------------------------------------------------ power
@dataclass(frozen=True)
class ClaimPower:
    claim: Claim
    n: int
    line: str  # what stalerl-study prints for the claim
    refusal: Optional[str] = None  # one line, when the claim may not run as registered


def claim_power(claim: Claim, n: int, alpha: float, m: int, level: str = "alpha") -> ClaimPower:
    """The claim's minimum detectable effect (one-sided) or expected half-width and power at 0 (equivalence), at n
    planned seeds, at its level alpha (an upper bound on the power once Holm adjusts across m claims) and at alpha / m
    (Holm's strictest step). ``level="holm"`` (a primary claim of a spec with ``power: holm``): the claim must reach
    POWER_TARGET at alpha / m (greater/less: at its stated ``effect``), else it is refused unless it says
    ``accept_low_power``."""
    holm = level == "holm"
    if claim.test == "collapses_more":
        line = (f"{claim.id} (collapses_more, n={n}): Fisher exact on collapse counts; power not computed (no paired "
                "SD)")
        refusal = None
        if holm and not claim.accept_low_power:
            refusal = (f"claim {claim.id}: power: holm needs every primary claim powered, and a collapses_more claim "
                       "has no paired SD; make it secondary or say accept_low_power: <why>")
        return ClaimPower(claim, n, line, refusal)
    head = f"{claim.id} ({claim.test}, {METRIC_NAMES.get(claim.metric, claim.metric)}, n={n})"
    if claim.expected_sd is None:
        line = f"{head}: no expected_sd stated, power unknown"
        refusal = None
        if (claim.test in MARGIN_TESTS or holm) and claim.accept_low_power is None:
            refusal = (f"claim {claim.id}: a {claim.test} claim must state expected_sd (the paired SD it expects, "
                       "from a pilot or an earlier study) so its power can be checked, or accept_low_power: <why>")
        return ClaimPower(claim, n, line, refusal)
    if n < 2:
        return ClaimPower(claim, n, f"{head}: fewer than 2 seeds, nothing can be shown",
                          None if claim.accept_low_power else f"claim {claim.id}: fewer than 2 planned seeds")
    sd = claim.expected_sd
    strict = alpha / max(m, 1)
    if claim.test in ("greater", "less"):
        mde, mde_strict = minimum_detectable_effect(sd, n, alpha), minimum_detectable_effect(sd, n, strict)
        line = (f"{head}: expected paired SD {sd:g}; minimum detectable effect (power {POWER_TARGET:g}) {mde:.3f} at "
                f"α {alpha:g}, {mde_strict:.3f} at α/{m} {strict:.4f}")
        if claim.effect is None:
            refusal = None
            if holm and not claim.accept_low_power:
                refusal = (f"claim {claim.id}: power: holm needs the smallest effect the claim is powered for; add "
                           f"effect: <difference> (at n={n} power {POWER_TARGET:g} needs >= {mde_strict:.3f}) or say "
                           "accept_low_power: <why>")
            return ClaimPower(claim, n, line, refusal)
        power_e = power_one_sided(claim.effect, sd, n, alpha)
        power_e_strict = power_one_sided(claim.effect, sd, n, strict)
        line += f"; power at a true difference of {claim.effect:g}: {power_e:.2f} at α, {power_e_strict:.2f} at α/{m}"
        if not holm:
            return ClaimPower(claim, n, line)
        return _with_refusal(claim, n, sd, line, power_e_strict, mde_strict, "an effect of", claim.effect)
    if claim.test == "noninferior":
        power0 = power_one_sided(claim.margin, sd, n, alpha)
        power0_strict = power_one_sided(claim.margin, sd, n, strict)
        needed = minimum_detectable_effect(sd, n, strict if holm else alpha)
        line = (f"{head}: expected paired SD {sd:g}; power at a true difference of 0 to show a > b - {claim.margin:g}: "
                f"{power0:.2f} at α {alpha:g}, {power0_strict:.2f} at α/{m}; margin for power {POWER_TARGET:g}: "
                f"{needed:.3f}")
        return _with_refusal(claim, n, sd, line, power0_strict if holm else power0, needed, "non-inferiority")
    half = t_quantile(1.0 - alpha, n - 1) * sd / n ** 0.5
    power0 = power_equivalence(0.0, sd, n, alpha, claim.margin)
    power0_strict = power_equivalence(0.0, sd, n, strict, claim.margin)
    needed = equivalence_margin_needed(sd, n, strict if holm else alpha)
    line = (f"{head}: expected paired SD {sd:g}; expected interval half-width {half:.3f} vs margin "
            f"±{claim.margin:g}; power at a true difference of 0: {power0:.2f} at α {alpha:g}, {power0_strict:.2f} "
            f"at α/{m}; margin for power {POWER_TARGET:g}: {needed:.3f}")
    return _with_refusal(claim, n, sd, line, power0_strict if holm else power0, needed, "equivalence")


def _with_refusal(claim: Claim, n: int, sd: float, line: str, power: float, needed: float, what: str,
                  effect: Optional[float] = None) -> ClaimPower:
    refusal = None
    if power < POWER_TARGET:
        if claim.accept_low_power:
            line += f"; underpowered, accepted: {claim.accept_low_power}"
        elif effect is not None:
            refusal = (f"claim {claim.id}: power {power:.2f} < {POWER_TARGET:g} at Holm's strictest level to detect "
                       f"{what} {effect:g} (n={n}, expected_sd {sd:g}); power {POWER_TARGET:g} needs an effect of at "
                       f"least {needed:.3f}: plan more seeds, or say accept_low_power: <why> in the claim")
        else:
            refusal = (f"claim {claim.id}: power {power:.2f} < {POWER_TARGET:g} to show {what} within "
                       f"{claim.margin:g} even at a true difference of 0 (n={n}, expected_sd {sd:g}); widen the "
                       f"margin to at least {needed:.3f}, plan more seeds, or say accept_low_power: <why> in the claim")
    return ClaimPower(claim, n, line, refusal)


def power_report(claim_set: ClaimSet, n: int) -> list[ClaimPower]:
    """Every claim's power statement at ``n`` planned seeds (see :func:`claim_power`): m is the size of the claim's
    Holm family (primary or secondary); with ``power: holm`` the primary claims are checked at alpha / m."""
    m_primary = len(claim_set.primary)
    m_secondary = len(claim_set.claims) - m_primary
    return [claim_power(c, n, claim_set.alpha, m_secondary if c.secondary else m_primary,
                        "holm" if claim_set.power == "holm" and not c.secondary else "alpha")
            for c in claim_set.claims]


# ------------------------------------------------------------------------------------------------ paired table
def render_paired_table(cells, claim_set: ClaimSet, metrics: Sequence[str] = ("last3", "auc")) -> list[str]:
    """One compact table: per stale setting and primary metric, each loss minus the on-policy baseline, M2PO minus
    clip, M2PO minus no trust region (paired mean ± 95% half-width, wins/n), with the adjusted verdicts of the
    claims on that row. The on-policy baseline is shown once, above the table."""
    base = claim_set.baseline  # None (e.g. an asynchronous grid with no on-policy run): no "- on-policy" columns
    results = evaluate(cells, claim_set)
    methods = list(dict.fromkeys(c.method for c in cells if (c.method, c.setting) != base))
    settings = list(dict.fromkeys(c.setting for c in cells if base is None or c.setting != base[1]))
    comparisons = [(f"{m} − on-policy", m, base) for m in methods] if base else []
    if "m2po" in methods:
        comparisons += [(f"m2po − {o}", "m2po", o) for o in ("vanilla", "no_trust_region") if o in methods]
    if not comparisons:
        return []
    intro = "Paired differences (mean over seeds ± 95% t half-width, then a-higher wins/n)."
    if base:
        base_runs = outcome_runs(cells, base)
        base_text = "; ".join(f"{METRIC_NAMES[m]} {format_estimate(mean_interval(v))}" for m in metrics
                              if (v := [x for r in base_runs if (x := run_metric(r, m, claim_set.rule)) is not None]))
        intro += f" On-policy baseline {_cell_name(base)} (n={len(base_runs)}): {base_text or 'no runs'}."
    header = ["setting", "metric", *(name for name, _, _ in comparisons), "claims (adjusted verdict)"]
    lines = [intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for setting in settings:
        for metric in metrics:
            row = [setting, METRIC_NAMES[metric]]
            for _, a_method, other in comparisons:
                b = other if isinstance(other, tuple) else (other, setting)
                pairs = paired_values(cells, (a_method, setting), b, metric, None, claim_set.rule)
                if not pairs:
                    row.append("-")
                    continue
                est = mean_interval([x - y for _, x, y in pairs])
                wins = sum(x > y for _, x, y in pairs)
                row.append(f"{format_estimate(est)} ({wins}/{len(pairs)})")
            tags = [f"{x.claim.id}: {x.verdict}" for x in results
                    if x.claim.metric == metric and setting in (x.claim.a[1], x.claim.b[1])
                    and x.claim.test != "collapses_more"]
            row.append("; ".join(tags) or "-")
            lines.append("| " + " | ".join(row) + " |")
    collapse = [x for x in results if x.claim.test == "collapses_more"]
    if collapse:
        lines += ["", *(f"- {x.claim.id} ({_what(x.claim)}): {x.evidence}; Holm p {_p(x.p_adj)}: "
                        f"**{x.verdict}**" for x in collapse)]
    return lines


def is_prereg(claims: Any) -> bool:
    """A new-style claims mapping (the legacy 'staleness' / 'async' strings keep their old rendering)."""
    return isinstance(claims, Mapping)

