"""A pilot's decision rule, fixed in the study spec before its runs. Two kinds:

- ``collapse`` (the default; issue 22, point 6): where does a stale loss prosper, then collapse, while on-policy
  training does not? Applied to the no-trust-region and on-policy runs only.
- ``degrade`` (issue 47): on which task and staleness does a stale loss (PPO's clip) visibly fall behind on-policy
  training, on a task that keeps learning? Applied to the clip and on-policy runs only; it also prints the
  seed-to-seed spread the confirmatory study's seeds are sized from.

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

The ``degrade`` kind::

    pilot:
      kind: degrade
      stale_loss: vanilla              # the loss whose degradation is sought (PPO clip)
      on_policy: fixed_staleness 0     # the on-policy runs' setting (same variant)
      step0: [0.05, 0.4]               # every on-policy seed's step-0 eval in this range (a task with room)
      prosper: 0.05                    # every on-policy seed's best eval >= this above its step-0 eval ...
      learns_until: 60                 # ... reached at a step >= this (learning goes on at least that long)
      degrade: 0.05                    # mean over seeds of (on-policy last3 - stale last3) >= this, and > 0 in
                                       # every seed (last3: the mean of the last 3 evals; paired by seed)

A regime (variant x stale setting) qualifies when the on-policy runs of its variant pass ``step0``, ``prosper`` and
``learns_until`` and the stale loss degrades. The chosen regime is the first qualifying one in the spec's order
(list the settings from the smallest staleness up). Beside each regime: the standard deviations over seeds of
last3 (on-policy, stale) and of the paired difference, the spread a study's power is computed from.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import math
import statistics

from stalerl.core.errors import refuse_unknown_keys
from stalerl_study.metrics import CollapseRule, collapsed, eval_curve, run_metric


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


def _on_policy_runs(cells: Sequence[Any], on_setting: str) -> dict[str, list[Mapping[str, Any]]]:
    """Variant -> the on-policy runs of that variant (any loss: on-policy every PPO-style loss is the same update)."""
    on: dict[str, list[Mapping[str, Any]]] = {}
    for c in cells:
        if c.setting == on_setting:
            loss = (c.finished or c.diverged or [{}])[0].get("loss")
            if loss:
                on[_variant(c.method, loss)] = [*c.finished, *c.diverged]
    return on


def _stale_cells(cells: Sequence[Any], stale_loss: str, on_setting: str):
    """(cell, its finished and diverged runs, its variant) of every stale setting's cell of ``stale_loss``: the
    only cells a pilot's rule reads besides the on-policy ones."""
    for c in cells:
        runs = [*c.finished, *c.diverged]
        if c.setting == on_setting or not runs or runs[0].get("loss") != stale_loss:
            continue
        yield c, runs, _variant(c.method, stale_loss)


def decide(cells: Sequence[Any], pilot: Mapping[str, Any], rule: CollapseRule) -> tuple[list[list[str]], Optional[str]]:
    """(rows of the decision table, the chosen regime or None)."""
    if pilot.get("kind", "collapse") == "degrade":
        return decide_degrade(cells, pilot, rule)
    stale_loss = pilot.get("stale_loss", "no_trust_region")
    on_setting = pilot.get("on_policy", "fixed_staleness 0")
    margin = float(pilot.get("prosper", 0.05))
    on = _on_policy_runs(cells, on_setting)
    rows, chosen = [], None
    for c, runs, var in _stale_cells(cells, stale_loss, on_setting):
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


def learns(run: Mapping[str, Any], margin: float, until: int) -> Optional[bool]:
    """The run's best eval is >= ``margin`` above its step-0 eval and is reached at a step >= ``until`` (the first
    step reaching the best, so a plateau reached early does not count as learning that goes on)."""
    pts = eval_curve(run)
    if not pts:
        return None
    best = max(v for _, v in pts)
    first_best = next(s for s, v in pts if v == best)
    return best - pts[0][1] >= margin and first_best >= until


def _sd(values: Sequence[float]) -> str:
    return f"{statistics.stdev(values):.3f}" if len(values) >= 2 else "n/a"


def decide_degrade(cells: Sequence[Any], pilot: Mapping[str, Any],
                   rule: CollapseRule) -> tuple[list[list[str]], Optional[str]]:
    """The ``degrade`` kind: (rows, the chosen regime or None). Reads only the stale loss and the on-policy runs."""
    stale_loss = pilot.get("stale_loss", "vanilla")
    on_setting = pilot.get("on_policy", "fixed_staleness 0")
    lo, hi = (float(x) for x in pilot.get("step0", (0.05, 0.4)))
    margin, until = float(pilot.get("prosper", 0.05)), int(pilot.get("learns_until", 60))
    need = float(pilot.get("degrade", 0.05))
    on = _on_policy_runs(cells, on_setting)
    rows, chosen = [], None
    for c, runs, var in _stale_cells(cells, stale_loss, on_setting):
        on_runs = on.get(var, [])
        step0 = [eval_curve(r)[0][1] for r in on_runs if eval_curve(r)]
        in_range = [lo <= v <= hi for v in step0]
        learned = [learns(r, margin, until) for r in on_runs]
        on_by_seed = {r.get("seed"): run_metric(r, "last3", rule) for r in on_runs}
        pairs = [(on_by_seed[r.get("seed")], run_metric(r, "last3", rule)) for r in runs
                 if on_by_seed.get(r.get("seed")) is not None and run_metric(r, "last3", rule) is not None]
        diffs = [a - b for a, b in pairs]
        mean_d = math.fsum(diffs) / len(diffs) if diffs else None
        task_ok = bool(on_runs) and len(step0) == len(on_runs) and all(in_range) and all(learned)
        degraded = bool(diffs) and mean_d >= need and all(d > 0 for d in diffs)
        ok = task_ok and degraded
        regime = f"{var or 'default'} @ {c.setting}"
        rows.append([regime, f"{sum(in_range)}/{len(on_runs)}", f"{sum(map(bool, learned))}/{len(on_runs)}",
                     "n/a" if mean_d is None else f"{mean_d:+.3f}", f"{sum(d > 0 for d in diffs)}/{len(diffs)}",
                     _sd([a for a, _ in pairs]), _sd([b for _, b in pairs]), _sd(diffs), "yes" if ok else "no"])
        if ok and chosen is None:
            chosen = regime
    return rows, chosen


def render_degrade(rows: list[list[str]], chosen: Optional[str], pilot: Mapping[str, Any]) -> str:
    stale_loss = pilot.get("stale_loss", "vanilla")
    lo, hi = pilot.get("step0", (0.05, 0.4))
    head = ["regime", f"on-policy step-0 in [{lo}, {hi}]",
            f"on-policy learns until step >= {pilot.get('learns_until', 60)}",
            f"on-policy - {stale_loss} (last3, mean)", "seeds > 0", "sd on-policy", f"sd {stale_loss}", "sd paired",
            "qualifies"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    if chosen:
        lines += ["", f"Chosen regime: {chosen}"]
    else:
        lines += ["", "No regime qualifies: a negative result. Per regime, what failed (and what held):", "",
                  *(f"- {_degrade_reasons(row, pilot)}" for row in rows)]
    return "\n".join(lines)


def _degrade_reasons(row: list[str], pilot: Mapping[str, Any]) -> str:
    """One regime's row of :func:`decide_degrade`, said as the conditions that failed and those that held."""
    regime, in_range, learned, mean_d, positive = row[:5]
    stale_loss = pilot.get("stale_loss", "vanilla")
    lo, hi = pilot.get("step0", (0.05, 0.4))
    until, need = pilot.get("learns_until", 60), pilot.get("degrade", 0.05)

    def whole(frac: str) -> bool:
        k, n = frac.split("/")
        return k == n and n != "0"

    task = [f"on-policy step-0 accuracy in [{lo}, {hi}] in {in_range} seeds",
            f"on-policy first reached its best at step >= {until} in {learned} seeds"]
    failed = [t for t, ok in zip(task, (whole(in_range), whole(learned))) if not ok]
    held = [t for t, ok in zip(task, (whole(in_range), whole(learned))) if ok]
    if mean_d == "n/a":
        failed.append(f"no seed has both the on-policy and the {stale_loss} run")
    else:
        trail = (f"{stale_loss} trailed on-policy by {mean_d} on average (last3), in {positive} seeds (needs >= "
                 f"{need} and every seed)")
        (held if float(mean_d) >= float(need) and whole(positive) else failed).append(trail)
    return f"{regime}: failed: {'; '.join(failed) or 'nothing'}; held: {'; '.join(held) or 'nothing'}"


def render(rows: list[list[str]], chosen: Optional[str], stale_loss: str) -> str:
    head = ["regime", f"{stale_loss} prospered", f"{stale_loss} collapsed", "on-policy collapsed", "qualifies"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    lines += ["", f"Chosen regime: {chosen}" if chosen else
              "No regime qualifies: a negative result (nothing prospered then collapsed where on-policy did not)."]
    return "\n".join(lines)


PILOT_KEYS = {"kind", "stale_loss", "on_policy", "prosper", "collapse", "outcome"}
DEGRADE_KEYS = PILOT_KEYS | {"step0", "learns_until", "degrade"}
PILOT_KINDS = ("collapse", "degrade")


def check_pilot(pilot: Any, where: str = "pilot") -> CollapseRule:
    """Validate a spec's ``pilot`` mapping; returns its collapse rule."""
    if not isinstance(pilot, Mapping):
        raise ValueError(f"{where}: expected a mapping with stale_loss, on_policy, prosper, collapse")
    kind = pilot.get("kind", "collapse")
    if kind not in PILOT_KINDS:
        raise ValueError(f"{where}.kind={kind!r}: expected one of {', '.join(PILOT_KINDS)}")
    refuse_unknown_keys(where, pilot, DEGRADE_KEYS if kind == "degrade" else PILOT_KEYS)

    def _share(key: str, value: Any, example: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{where}.{key}={value!r}: expected an accuracy in [0, 1], e.g. {example}")

    _share("prosper", pilot.get("prosper", 0.05), "0.05")
    if kind == "degrade":
        _share("degrade", pilot.get("degrade", 0.05), "0.05")
        step0 = pilot.get("step0", [0.05, 0.4])
        if not isinstance(step0, (list, tuple)) or len(step0) != 2:
            raise ValueError(f"{where}.step0={step0!r}: expected [low, high], e.g. [0.05, 0.4]")
        for v in step0:
            _share("step0", v, "[0.05, 0.4]")
        if step0[0] > step0[1]:
            raise ValueError(f"{where}.step0={list(step0)!r}: expected low <= high, e.g. [0.05, 0.4]")
        until = pilot.get("learns_until", 60)
        if isinstance(until, bool) or not isinstance(until, int) or until < 0:
            raise ValueError(f"{where}.learns_until={until!r}: expected a step >= 0, e.g. 60")
    return CollapseRule.from_spec(pilot.get("collapse"), f"{where}.collapse")


def incomplete(cells: Sequence[Any], pilot: Mapping[str, Any]) -> Optional[str]:
    """Why the rule cannot be applied yet (a cell it reads, on-policy or the stale loss's, has seeds not collected or
    runs that did not finish, e.g. stopped by a session's end and still to resume), or None. A verdict over part of
    the grid would be read as one."""
    stale_loss = pilot.get("stale_loss", "no_trust_region" if pilot.get("kind", "collapse") == "collapse" else "vanilla")
    on_setting = pilot.get("on_policy", "fixed_staleness 0")

    def stale(c: Any) -> bool:
        return c.setting != on_setting and (stale_loss == c.method or f"loss={stale_loss}" in c.method.split(", "))

    # on-policy: the cells that ran (a grid lists every loss there; specs run it once); stale: every cell of the loss
    read = [c for c in cells if stale(c) or (c.setting == on_setting and (c.finished or c.diverged or c.failed))]
    short = [f"{c.method} @ {c.setting} ({len(c.missing) + len(c.failed)} of {c.expected})"
             for c in read if c.missing or c.failed]
    if not short:
        return None
    done = sum(len(c.finished) + len(c.diverged) for c in read)
    total = sum(c.expected for c in read)
    return (f"Rule not applied yet: {done} of {total} runs collected; not finished: {', '.join(short)}. The decision "
            "is made when every run is in.")


def render_pilot(cells: Sequence[Any], pilot: Mapping[str, Any]) -> str:
    rule = check_pilot(pilot)
    why = incomplete(cells, pilot)
    if why:
        return why
    rows, chosen = decide(cells, pilot, rule)
    if pilot.get("kind", "collapse") == "degrade":
        return render_degrade(rows, chosen, pilot)
    return render(rows, chosen, pilot.get("stale_loss", "no_trust_region"))
