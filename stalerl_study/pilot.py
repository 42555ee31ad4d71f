"""The pilot's decision rule (issue 22, point 6), applied to the no-trust-region and on-policy runs only.

    stalerl-study pilot docs/algorithms/results/chain_pilot --spec examples/math/study/chain_pilot.yaml

The spec's ``pilot`` mapping states the rule before the pilot runs::

    pilot:
      stale_loss: no_trust_region      # the loss whose collapse is sought
      on_policy: fixed_staleness 0     # the setting of the on-policy runs (same optimizer variant)
      prosper: 0.05                    # early peak - step-0 eval, in every seed
      collapse: {after_step: 100, drop: 0.1, consecutive: 2, early_end: 150, final_evals: 3}

A *regime* is one optimizer variant (the method label minus the loss) x one stale setting. It qualifies when, in
every pilot seed, the stale loss first prospers (its best eval up to ``collapse.early_end`` is >= ``prosper`` above
its step-0 eval) and then collapses (``collapse``: stalerl_study.metrics.CollapseRule; a diverged run
collapses), while no on-policy run of the same variant collapses. The study report renders this table in the pilot's
block (``pilot`` is copied into study.json). The chosen regime is the qualifying one with the smallest staleness,
then the order of the spec's variants. M2PO, clip and FIPO runs are never read: the regime is chosen without looking
at them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from stalerl.core.errors import refuse_unknown_keys
from stalerl_study.metrics import CollapseRule, collapsed, eval_curve


def _variant(method: str, loss: str) -> str:
    """'loss=no_trust_region, lr=0.0003, ...' -> 'lr=0.0003, ...' (a bare loss label -> '')."""
    parts = [p for p in method.split(", ") if p != f"loss={loss}" and p != loss]
    return ", ".join(parts)


def prospered(run: Mapping[str, Any], rule: CollapseRule, margin: float) -> Optional[bool]:
    pts = eval_curve(run)
    if not pts:
        return None
    early = [v for s, v in pts if s <= rule.early_end]
    return max(early) - pts[0][1] >= margin


def decide(cells: Sequence[Any], pilot: Mapping[str, Any], rule: CollapseRule) -> tuple[list[list[str]], Optional[str]]:
    """(rows of the decision table, the chosen regime or None)."""
    stale_loss = pilot.get("stale_loss", "no_trust_region")
    on_setting = pilot.get("on_policy", "fixed_staleness 0")
    margin = float(pilot.get("prosper", 0.05))
    on = {}
    for c in cells:
        if c.setting == on_setting:
            loss = (c.finished or c.diverged or [{}])[0].get("loss")
            if loss:
                on[_variant(c.method, loss)] = [*c.finished, *c.diverged]
    rows, chosen = [], None
    for c in cells:
        runs = [*c.finished, *c.diverged]
        if c.setting == on_setting or not runs or runs[0].get("loss") != stale_loss:
            continue
        var = _variant(c.method, stale_loss)
        pros = [prospered(r, rule, margin) for r in runs]
        coll = [collapsed(r, rule) for r in runs]
        on_coll = [collapsed(r, rule) for r in on.get(var, [])]
        ok = bool(runs) and all(pros) and all(coll) and bool(on_coll) and not any(on_coll)
        regime = f"{var or 'default'} @ {c.setting}"
        rows.append([regime, f"{sum(map(bool, pros))}/{len(runs)}", f"{sum(map(bool, coll))}/{len(runs)}",
                     f"{sum(map(bool, on_coll))}/{len(on_coll)}", "yes" if ok else "no"])
        if ok and chosen is None:
            chosen = regime
    return rows, chosen


def render(rows: list[list[str]], chosen: Optional[str], stale_loss: str) -> str:
    head = ["regime", f"{stale_loss} prospered", f"{stale_loss} collapsed", "on-policy collapsed", "qualifies"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    lines += ["", f"Chosen regime: {chosen}" if chosen else
              "No regime qualifies: a negative result (nothing prospered then collapsed where on-policy did not)."]
    return "\n".join(lines)


PILOT_KEYS = {"stale_loss", "on_policy", "prosper", "collapse", "outcome"}


def check_pilot(pilot: Any, where: str = "pilot") -> CollapseRule:
    """Validate a spec's ``pilot`` mapping; returns its collapse rule."""
    if not isinstance(pilot, Mapping):
        raise ValueError(f"{where}: expected a mapping with stale_loss, on_policy, prosper, collapse")
    refuse_unknown_keys(where, pilot, PILOT_KEYS)
    prosper = pilot.get("prosper", 0.05)
    if isinstance(prosper, bool) or not isinstance(prosper, (int, float)) or not 0 <= prosper <= 1:
        raise ValueError(f"{where}.prosper={prosper!r}: expected an accuracy gain in [0, 1], e.g. 0.05")
    return CollapseRule.from_spec(pilot.get("collapse"), f"{where}.collapse")


def render_pilot(cells: Sequence[Any], pilot: Mapping[str, Any]) -> str:
    rows, chosen = decide(cells, pilot, check_pilot(pilot))
    return render(rows, chosen, pilot.get("stale_loss", "no_trust_region"))
