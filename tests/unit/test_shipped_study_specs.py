"""smollm2_stale (issue 36 item 4) shares its staleness-4 runs with smollm2_add: the same run directories and
resolved configs, so the study reuses them instead of paying 26 min again (every shipped spec's validation is in
test_study_specs.py::test_a_shipped_study_spec_resolves_its_whole_grid)."""

from __future__ import annotations

from pathlib import Path

from stalerl_study.cli import check_settings, expand, load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_staleness_probe_shares_its_staleness_4_runs_with_smollm2_add(monkeypatch):
    # smollm2_stale reuses smollm2_add's seed-1 runs at staleness 4: same run directory, same resolved config
    monkeypatch.chdir(ROOT)
    from stalerl.config import run_dir
    from stalerl.results.run_summary import stable_digest

    study = ROOT / "examples" / "math" / "study"
    add, stale = load_spec(study / "smollm2_add.yaml"), load_spec(study / "smollm2_stale.yaml")
    add_runs = {r["trial"]: c for r, c in zip(expand(add), check_settings(add, expand(add)))}
    stale_runs = {r["trial"]: c for r, c in zip(expand(stale), check_settings(stale, expand(stale)))}
    shared = sorted(set(add_runs) & set(stale_runs))
    assert shared == ["m2po-fixed_staleness_4-seed1", "vanilla-fixed_staleness_4-seed1"]
    for trial in shared:
        assert run_dir(add_runs[trial]) == run_dir(stale_runs[trial])
        assert stable_digest(add_runs[trial]) == stable_digest(stale_runs[trial])
    assert {c.rollout.fixed_staleness for c in stale_runs.values()} == {0, 4, 16}
