"""Power at registration and the exact sign-flip p (issue 30, item 3), and the pre-registered specs of items 4-6.

- sign_flip_p against a literal enumeration of every sign vector;
- the power functions against simulated studies (paired t, TOST, non-inferiority on normal differences);
- stalerl-study prints each claim's power and refuses an underpowered equivalence / non-inferiority claim unless the
  claim says accept_low_power;
- chain_tau, chain_lr and add_noclip load, validate their configs and labels, and pass their own power check.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import yaml

from conftest import REPO
from stalerl_study.cli import StudyError, _grid, check_power, check_settings, expand, load_spec, main
from stalerl_study.prereg import parse_claims, power_report
from stalerl_study.stats import (equivalence_margin_needed, minimum_detectable_effect, paired_test,
                                 power_equivalence, power_one_sided, sign_flip_equivalence_p, sign_flip_p,
                                 t_quantile)

STUDY = REPO / "examples" / "math" / "study"


# ------------------------------------------------------------------------------------------------ sign flips
def literal_sign_flip(diffs, alternative, shift=0.0):
    """Every sign vector s in {-1, +1}^n, the mean of s_i |d_i - shift|, compared with the observed mean."""
    xs = [d - shift for d in diffs]
    n = len(xs)
    observed = sum(xs) / n
    tol = 1e-9 * max(1.0, sum(abs(x) for x in xs)) / n
    hits = 0
    for signs in itertools.product((1, -1), repeat=n):
        m = sum(s * abs(x) for s, x in zip(signs, xs)) / n
        hits += (m >= observed - tol) if alternative == "greater" else (m <= observed + tol)
    return hits / 2 ** n


@pytest.mark.parametrize("seed", range(40))
def test_sign_flip_p_is_the_literal_enumeration(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    if seed % 4 == 0:  # ties and zeros: integer differences
        diffs = [float(rng.randint(-3, 3)) for _ in range(n)]
    else:
        diffs = [rng.gauss(rng.uniform(-0.05, 0.05), 0.05) for _ in range(n)]
    shift = [0.0, 0.02, -0.03][seed % 3]
    for alternative in ("greater", "less"):
        assert sign_flip_p(diffs, alternative, shift) == pytest.approx(literal_sign_flip(diffs, alternative, shift),
                                                                       abs=1e-12)


def test_sign_flip_floor_and_limits():
    assert sign_flip_p([0.1] * 8, "greater") == 1 / 256  # the floor at 8 seeds
    assert sign_flip_p([0.1] * 8, "less") == 1.0
    assert sign_flip_p([], "greater") is None and sign_flip_p([0.1] * 21, "greater") is None
    # equivalence: all differences near 0 and well inside the margin
    assert sign_flip_equivalence_p([0.01, -0.01, 0.0, 0.02, -0.02, 0.01, 0.0, -0.01], 0.1) == 1 / 256
    with pytest.raises(ValueError, match="alternative"):
        sign_flip_p([0.1], "two-sided")


# ------------------------------------------------------------------------------------------------ power
def _simulate(rule, true_diff, sd, n, sims=6000, seed=0):
    rng = random.Random(seed)
    hits = sum(rule(paired_test([rng.gauss(true_diff, sd) for _ in range(n)])) for _ in range(sims))
    return hits / sims, math.sqrt(0.25 / sims)


@pytest.mark.parametrize("n,sd,effect", [(8, 0.024, 0.02), (8, 0.062, 0.05), (5, 0.03, 0.04)])
def test_one_sided_power_matches_simulated_paired_t_tests(n, sd, effect):
    got = power_one_sided(effect, sd, n, 0.025)
    sim, se = _simulate(lambda t: t.p_greater() <= 0.025, effect, sd, n)
    assert abs(got - sim) < 4 * se


@pytest.mark.parametrize("n,sd,margin,true_diff", [(8, 0.062, 0.05, 0.0), (8, 0.0278, 0.05, 0.0),
                                                   (6, 0.03, 0.06, 0.02)])
def test_equivalence_power_matches_simulated_tost(n, sd, margin, true_diff):
    got = power_equivalence(true_diff, sd, n, 0.025, margin)
    sim, se = _simulate(lambda t: t.p_equivalent(margin) <= 0.025, true_diff, sd, n, seed=1)
    assert abs(got - sim) < 4 * se


def test_issue_figures_and_inverse_functions():
    # the issue's arithmetic: paired SD 0.062 at 8 seeds gives a 95% half-width of 0.052 > margin 0.05
    assert t_quantile(0.975, 7) * 0.062 / math.sqrt(8) == pytest.approx(0.0518, abs=1e-4)
    assert power_equivalence(0.0, 0.062, 8, 0.025, 0.05) < 0.5
    mde = minimum_detectable_effect(0.024, 8, 0.025)
    assert power_one_sided(mde, 0.024, 8, 0.025) == pytest.approx(0.8, abs=1e-6)
    margin = equivalence_margin_needed(0.062, 8, 0.025)
    assert power_equivalence(0.0, 0.062, 8, 0.025, margin) == pytest.approx(0.8, abs=1e-6)


# ------------------------------------------------------------------------------------------------ refusal
def _spec(tmp_path, claim: dict, seeds=(1, 2, 3, 4, 5, 6, 7, 8)):
    spec = {"name": "p", "config": str(REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"),
            "losses": ["vanilla", "m2po"], "seeds": list(seeds),
            "settings": {"fixed_staleness 0": ["rollout.fixed_staleness=0"],
                         "fixed_staleness 64": ["rollout.fixed_staleness=64"]},
            "setting_losses": {"fixed_staleness 0": ["vanilla"]},
            "results": str(tmp_path / "res"), "doc": str(tmp_path / "doc.md"),
            "claims": {"list": [{"id": "c", "text": "t", "a": "m2po @ fixed_staleness 64",
                                 "b": "vanilla @ fixed_staleness 0", "metric": "last3", **claim}]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("claim,message", [
    ({"test": "equivalent", "margin": 0.05, "expected_sd": 0.062}, r"claim c: power 0\.18 < 0\.8 .* at least 0\.083"),
    ({"test": "equivalent", "margin": 0.05}, "must state expected_sd"),
    ({"test": "noninferior", "margin": 0.01, "expected_sd": 0.05}, r"power 0\.\d\d < 0\.8 to show non-inferiority"),
])
def test_underpowered_claims_are_refused_before_any_run(tmp_path, capsys, claim, message):
    path = _spec(tmp_path, claim)
    with pytest.raises(StudyError, match=message):
        check_power(load_spec(path))
    # the command refuses with one line and exit code 2, before a run, a warm start or a results directory exists
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalerl-study: claim c") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "res").exists()


def test_accept_low_power_lets_the_claim_run_and_says_so(tmp_path):
    path = _spec(tmp_path, {"test": "equivalent", "margin": 0.05, "expected_sd": 0.062,
                            "accept_low_power": "a replication of a registered claim"})
    lines = []
    check_power(load_spec(path), out=lines.append)
    assert any("power at a true difference of 0: 0.18" in x and "accepted: a replication" in x for x in lines)
    # a well-powered claim runs without it; the power is the registered plan's even when --seeds cuts the grid
    path = _spec(tmp_path, {"test": "equivalent", "margin": 0.05, "expected_sd": 0.0278})
    spec = load_spec(path)
    spec["seeds"] = [1, 2]
    lines = []
    check_power(spec, out=lines.append)
    assert "n=8" in lines[1] and "runs 2 of the 8 registered seeds" in lines[-1]


def test_bad_power_keys_fail_with_one_line_naming_the_key():
    base = {"id": "c", "text": "t", "a": "m @ s", "b": "v @ s", "test": "greater"}
    for extra, message in (({"expected_sd": -1}, "expected_sd=-1"), ({"expected_sd": "big"}, "expected_sd='big'"),
                           ({"accept_low_power": ""}, "accept_low_power=''"),
                           ({"test": "noninferior"}, "non-inferiority claim needs a margin"),
                           ({"test": "collapses_more", "expected_sd": 0.1}, "has no paired SD")):
        with pytest.raises(ValueError, match=message):
            parse_claims({"list": [{**base, **extra}]})


# ------------------------------------------------------------------------------------------------ the new specs
@pytest.mark.parametrize("name,runs_per_seed,claims", [("chain_tau", 6, 6), ("chain_lr", 4, 6), ("add_noclip", 2, 2)])
def test_issue_30_specs_load_validate_and_pass_their_power_check(name, runs_per_seed, claims):
    spec = load_spec(STUDY / f"{name}.yaml")
    assert len(expand(spec)) == 8 * runs_per_seed
    assert len(parse_claims(spec["claims"]).claims) == claims
    lines = []
    check_power(spec, out=lines.append)  # no refusal: every margin claim has power >= 0.8 at a true difference of 0
    report = power_report(parse_claims(spec["claims"]), 8)
    assert all(p.refusal is None for p in report)
    assert all("expected paired SD" in p.line for p in report if p.claim.test != "collapses_more")
    spec["seeds"] = [1]
    check_settings(spec, expand(spec))  # labels and settings are what the runs report


def test_chain_tau_runs_tau_variants_for_m2po_only(tmp_path):
    spec = load_spec(STUDY / "chain_tau.yaml")
    assert sorted(map(tuple, _grid(spec))) == sorted([
        ("loss=vanilla, m2_threshold=0.04", "fixed_staleness 0"),
        ("loss=vanilla, m2_threshold=0.04", "fixed_staleness 64"),
        ("loss=m2po, m2_threshold=0.04", "fixed_staleness 64"),
        ("loss=m2po, m2_threshold=0.01", "fixed_staleness 64"),
        ("loss=m2po, m2_threshold=0.0025", "fixed_staleness 64"),
        ("loss=m2po_authors, m2_threshold=0.04", "fixed_staleness 64")])
    raw = yaml.safe_load((STUDY / "chain_tau.yaml").read_text())
    raw["variant_losses"] = {"tau0.5": ["m2po"]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(StudyError, match="variant_losses names 'tau0.5'"):
        load_spec(path)


def test_the_registered_studies_still_rerun_with_their_power_documented():
    for name in ("staleness", "chain_staleness"):
        lines = []
        check_power(load_spec(STUDY / f"{name}.yaml"), out=lines.append)
        assert any("underpowered, accepted: registered before power was checked" in x for x in lines)


# ------------------------------------------------------------------------------------------------ the report
def _summary(loss, setting, seed, level, quadrants=None):
    curve = [[s, level + s / 3000] for s in range(0, 301, 25)]
    out = {"schema": 2, "run": f"{loss}-{setting}-{seed}", "status": "finished", "seed": seed, "loss": loss,
           "setting": setting, "steps_planned": 300, "eval_every": 25, "curves": {"eval/accuracy": curve}}
    if quadrants is not None:
        out["diagnostics"] = {f"actor/m2po/{k}": {"mean": v, "max": v} for k, v in quadrants.items()}
    return out


def test_report_shows_the_sign_flip_column_noninferiority_and_quadrants_only_when_logged():
    from stalerl_study.report import group, render_markdown

    claims = {"baseline": "vanilla @ fixed_staleness 0", "list": [
        {"id": "ni", "text": "m2po not worse", "test": "noninferior", "margin": 0.05, "metric": "auc",
         "a": "m2po @ fixed_staleness 64", "b": "vanilla @ fixed_staleness 0"}]}
    rng = random.Random(3)
    old = [_summary("vanilla", "fixed_staleness 0", s, 0.4 + 0.01 * s) for s in range(1, 9)]
    old += [_summary("m2po", "fixed_staleness 64", s, 0.4 + 0.01 * s + rng.uniform(-0.01, 0.01)) for s in range(1, 9)]
    md = render_markdown(group(old), study="t", claims=claims)
    assert "| claim | test | evidence | p | Holm p | sign-flip p (Holm) | verdict |" in md
    assert "m2po @ fixed_staleness 64 not below vanilla @ fixed_staleness 0: eval-curve AUC by 0.05 or more" in md
    assert "| 0.0039 (0.0039) | **holds** |" in md  # every seed inside the margin: the sign-flip floor at n = 8
    assert "Removed tokens by trust-region quadrant" not in md  # summaries without the diagnostics: no table
    q = {"num_masked_pos_r_gt_1": 1.0, "num_masked_neg_r_lt_1": 3.0, "masked_weight_share_pos_r_gt_1": 0.02,
         "masked_weight_share_neg_r_lt_1": 0.001}
    new = old[:8] + [_summary("m2po", "fixed_staleness 64", s, 0.4 + 0.01 * s, q) for s in range(1, 9)]
    md = render_markdown(group(new), study="t", claims=claims)
    assert "Removed tokens by trust-region quadrant" in md
    assert "| fixed_staleness 64 | m2po | m2po masked | 1.00 ± 0.00 | 0.0200 ± 0.0000 | 3.00 ± 0.00 | 0.0010 ± 0.0000 |" in md
