"""Every shipped study spec resolves: its keys, its configs with every override, its grid (``--dry-run``: nothing
runs). The study issue's pilot also resumes across sessions: its runs checkpoint (recover.mode=auto)."""
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
    assert runs and lines[0].startswith(f"{len(runs)} runs ("), out


def test_the_pilot_resumes_a_run_a_session_end_stopped():
    s = load_spec(REPO / "examples" / "math" / "study" / "smollm2_pilot.yaml")
    assert "recover.mode=auto" in s["overrides"] and not any(o.startswith("recover.mode=disabled") for o in s["overrides"])
    assert s["pilot"]["kind"] == "degrade" and s["losses"] == ["vanilla"]
    assert os.path.basename(s["config"]) == "smollm2_add_m2po_cpu.yaml"
