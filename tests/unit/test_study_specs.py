"""Every shipped study spec resolves: its keys, its configs with every override, its grid (``--dry-run``: nothing
runs), its results directory and doc block. The study issue's pilot also resumes across sessions: its runs checkpoint (recover.mode=auto)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from stalerl_study.cli import load_spec, main

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted((REPO / "examples" / "math" / "study").glob("*.yaml"))


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_a_shipped_study_spec_resolves_its_whole_grid(spec, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # paths in a spec are relative to the repository root
    assert main(["run", str(spec.relative_to(REPO)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    s = load_spec(spec)
    _, _, listing = out.rpartition(f"study {s['name']}: ")  # the power lines (specs with claims) come first
    lines = listing.splitlines()
    runs = [ln.strip() for ln in lines[1:] if ln.startswith("  ")]
    assert len(runs) >= 5 and lines[0].startswith(f"{len(runs)} runs ("), out
    # where its summaries and its doc block go (the dry run loaded every run's config: a loss added to `losses` that
    # does not exist, or a setting named otherwise than its runs report, fails above)
    assert s["results"] == f"docs/algorithms/results/{s['name']}"
    assert f"<!-- results:begin {s['name']} -->" in (REPO / s["doc"]).read_text()


def test_the_pilot_resumes_a_run_a_session_end_stopped():
    s = load_spec(REPO / "examples" / "math" / "study" / "smollm2_pilot.yaml")
    assert "recover.mode=auto" in s["overrides"] and not any(o.startswith("recover.mode=disabled") for o in s["overrides"])
    assert s["pilot"]["kind"] == "degrade" and s["losses"] == ["vanilla"]
    assert os.path.basename(s["config"]) == "smollm2_add_m2po_cpu.yaml"


def test_the_registered_smollm2_study_is_the_pilots_configuration_on_fresh_seeds_and_powered(capsys):
    """Issue 47's registration: the pilot's overrides (so its spread applies), seeds disjoint from the pilot's (its
    clip runs chose the regime), every primary claim powered at Holm's strictest level at the registered seeds, and
    not at fewer (the seeds were sized, not padded)."""
    from stalerl_study.cli import check_power
    from stalerl_study.prereg import parse_claims, power_report

    study = load_spec(REPO / "examples" / "math" / "study" / "smollm2_study.yaml")
    pilot = load_spec(REPO / "examples" / "math" / "study" / "smollm2_pilot.yaml")
    assert study["config"] == pilot["config"] and study["overrides"] == pilot["overrides"]
    assert not set(study["seeds"]) & set(pilot["seeds"])
    claims = parse_claims(study["claims"])
    assert claims.power == "holm" and len(claims.primary) == 3
    check_power(study)  # raises (StudyError) on an underpowered primary claim
    assert "α/3" in capsys.readouterr().out
    fewer = power_report(claims, len(study["seeds"]) - 1)
    assert any(p.refusal for p in fewer), "one seed fewer would also be powered: the seeds are not sized"
