"""The published claims, checked against a study's numbers (so the doc's verdicts are generated, never typed).

Comparisons are paired by seed: within one study a seed fixes the initial weights, the warm-started model and the
data order for every method and setting, so "A < B" is judged on the per-seed differences A_seed - B_seed. It
*holds* when the two-sided 95% Student-t interval of the mean difference lies entirely below 0, *does not hold*
when it lies entirely above, and is *inconclusive* when it contains 0 (or fewer than two seeds have both values).
Pairing removes the seed-to-seed spread of the warm start, which dominates the unpaired intervals in the tables.
The verdict is about this scale and these seeds only.

- ``staleness`` (loss x fixed_staleness; the M2PO paper): clip degrades with staleness; no trust region prospers
  then collapses; M2PO tracks on-policy; M2PO masks far fewer tokens than clip clips.
- ``async`` (AReaL's M2PO doc): GRPO's (vanilla) grad norm is higher than M2PO's; M2PO's eval accuracy is higher.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

from stalerl_study.stats import Estimate, format_estimate, mean_interval

KINDS = ("staleness", "async")


def compare(diff: Estimate) -> str:
    """'<' / '>' when the interval of a difference lies below / above 0, '~' when it contains 0, '?' when n < 2."""
    if diff.half_width is None:
        return "?"
    if diff.high < 0:
        return "<"
    if diff.low > 0:
        return ">"
    return "~"


def _seed_pairs(a, b, field: str, field_b: Optional[str] = None) -> list[tuple[float, float]]:
    """(a_seed, b_seed) for the seeds both cells finished with the field (a, b: report Cells), in seed order."""
    av, bv = a.per_seed(field), b.per_seed(field_b or field)
    return [(av[s], bv[s]) for s in sorted(set(av) & set(bv))]


def paired_difference(a, b, field: str, field_b: Optional[str] = None) -> Estimate:
    """Mean and 95% interval of a_seed - b_seed over the seeds both cells finished (a, b: report Cells)."""
    return mean_interval([x - y for x, y in _seed_pairs(a, b, field, field_b)])


def _word(result: str, want: str, consistent: bool = False) -> str:
    """One comparison's verdict. consistent=True: the claim is 'not on the wrong side' (tracking), so an interval
    containing 0 is consistent with it rather than inconclusive."""
    if result == want:
        return "holds"
    if result in ("~", "?"):
        return "consistent" if consistent and result == "~" else "inconclusive"
    return "does not hold"


def _verdict(labels: Sequence[str], results: Sequence[str], want: str, consistent: bool = False) -> str:
    """'**holds** at every setting', or the settings grouped by verdict when they differ."""
    words = [_word(r, want, consistent) for r in results]
    if not words:
        return "**not measured**"
    if len(set(words)) == 1:
        return f"**{words[0]}**" + (" at every setting" if len(words) > 1 else f" at {labels[0]}")
    return "; ".join(f"**{w}** at {', '.join(lab for lab, x in zip(labels, words) if x == w)}"
                     for w in dict.fromkeys(words))


def _stale(setting: str) -> Optional[int]:
    m = re.fullmatch(r"(?:fixed_staleness|stale) (\d+).*", setting)
    return int(m.group(1)) if m else None


def _fmt(e: Estimate, digits: int = 3) -> str:
    return format_estimate(e, digits)


def _paired_claim(pairs, names: tuple[str, str], field: str, field_b: Optional[str] = None, *, want: str,
                  consistent: bool = False, digits: int = 3) -> str:
    """Verdict and evidence for [(setting, cell a, cell b)]: a - b paired by seed, claimed to be `want` 0.
    names: how the evidence calls a and b."""
    labels, res, parts = [], [], []
    for label, a, b in pairs:
        seeds = _seed_pairs(a, b, field, field_b)
        if not seeds:
            continue
        d = mean_interval([x - y for x, y in seeds])
        labels.append(label)
        res.append(compare(d))
        higher = sum(x > y for x, y in seeds)
        parts.append(f"{label}: {names[0]} {_fmt(a.estimate(field), digits)} vs {names[1]} "
                     f"{_fmt(b.estimate(field_b or field), digits)}, paired difference {_fmt(d, digits)}, "
                     f"{names[0]} higher in {higher}/{d.n} seeds")
    return f"{_verdict(labels, res, want, consistent)} ({'; '.join(parts) or 'no data'})"


def staleness_claims(cells) -> list[str]:
    get: Callable[[str, str], Optional[object]] = lambda m, s: next(  # noqa: E731
        (c for c in cells if c.method == m and c.setting == s and c.finished), None)
    settings = sorted({c.setting for c in cells if _stale(c.setting) is not None}, key=_stale)
    on = next((s for s in settings if _stale(s) == 0), None)
    stale = [s for s in settings if _stale(s)]

    def against(loss: str, other: Callable[[str], Optional[object]]):
        """[(S, this loss at S, the other cell for S)] for every S > 0 where both finished."""
        return [(s, get(loss, s), other(s)) for s in stale if get(loss, s) and other(s)]

    def on_policy(loss: str) -> Callable[[str], Optional[object]]:
        return lambda s: get(loss, on) if on else None

    def vs_vanilla(s: str) -> Optional[object]:
        return get("vanilla", s)

    stale_vs_on = ("stale", "on-policy")
    out = []
    # 1. Clip degrades with staleness: vanilla's final eval below its own on-policy value, seed by seed.
    degrades = _paired_claim(against("vanilla", on_policy("vanilla")), stale_vs_on, "eval.final", want="<")
    out.append(f"Clip (vanilla/GRPO) degrades with staleness (final eval below on-policy vanilla): {degrades}.")
    # 2. No trust region prospers then collapses: per seed, best eval minus final eval above 0 at the largest S.
    if stale and get("no_trust_region", stale[-1]):
        c = get("no_trust_region", stale[-1])
        drop = mean_interval([r["eval"]["best"] - r["eval"]["final"] for r in c.finished
                              if r["eval"].get("best") is not None and r["eval"].get("final") is not None])
        out.append(f"No trust region prospers then collapses (best minus final eval above 0): "
                   f"{_verdict([stale[-1]], [compare(drop)], '>')} (drop {_fmt(drop)}).")
    else:
        out.append("No trust region prospers then collapses: **not measured**.")
    # 3. M2PO tracks on-policy: its final eval is not below on-policy M2PO's at any S, seed by seed.
    tracks = _paired_claim(against("m2po", on_policy("m2po")), stale_vs_on, "eval.final", want=">", consistent=True)
    out.append(f"M2PO tracks on-policy (final eval not below on-policy M2PO): {tracks}.")
    # 4. M2PO beats clip at the same staleness (the paper's headline comparison).
    beats = _paired_claim(against("m2po", vs_vanilla), ("m2po", "vanilla"), "eval.final", want=">")
    out.append(f"M2PO's final eval is higher than clip's (vanilla/GRPO) at the same staleness: {beats}.")
    # 5. M2PO masks far fewer tokens than clip clips (same seed, same S).
    masked = _paired_claim(against("m2po", vs_vanilla), ("m2po masked", "vanilla clipped"),
                           "fractions.m2po/masked_fraction", "fractions.vanilla/clip_fraction", want="<", digits=4)
    out.append(f"M2PO masks fewer tokens than clip clips: {masked}.")
    return out


def async_claims(cells) -> list[str]:
    settings = list(dict.fromkeys(c.setting for c in cells))
    get = lambda m, s: next((c for c in cells if c.method == m and c.setting == s and c.finished), None)  # noqa: E731
    pairs = [(s, get("vanilla", s), get("m2po", s)) for s in settings if get("vanilla", s) and get("m2po", s)]
    names = ("vanilla", "m2po")
    return [f"GRPO's (vanilla) mean grad norm is higher than M2PO's: "
            f"{_paired_claim(pairs, names, 'grad_norm.mean', want='>')}.",
            f"M2PO's final eval accuracy is higher than GRPO's (vanilla): "
            f"{_paired_claim(pairs, names, 'eval.final', want='<')}."]


def render_claims(cells, kind: str) -> list[str]:
    if kind not in KINDS:
        raise ValueError(f"unknown claims kind {kind!r}; expected one of {', '.join(KINDS)}")
    claims = staleness_claims(cells) if kind == "staleness" else async_claims(cells)
    return ["Claims checked against these numbers, paired by seed (a seed fixes the initial weights, the warm-started "
            "model and the data order across methods and settings; a ± b is the mean per-seed difference and the "
            "half-width of its two-sided 95% Student-t interval). Holds / does not hold: that interval lies on / "
            "against the claimed side of 0; inconclusive: it contains 0, or fewer than 2 seeds; consistent: it "
            "contains 0 where the claim is 'not below' (tracking predicts that, but it does not prove equality):", "",
            *(f"- {c}" for c in claims)]
