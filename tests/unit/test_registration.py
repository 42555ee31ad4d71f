"""stalerl-study registration: a run counts as registered only when it ran from a clean commit that already holds
the spec byte for byte (stalerl_study.registration); every other case fails with one line naming the run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from stalerl_study.cli import main


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, msg: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", msg)
    return _git(repo, "rev-parse", "HEAD")


def _summary(results: Path, run: str, commit, dirty=False) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{run}.json").write_text(json.dumps({
        "schema": 2, "run": run, "experiment": "study-s", "status": "finished", "seed": 1, "loss": "m2po",
        "setting": "fixed_staleness 32", "code": {"commit": commit, "dirty": dirty, "dirty_digest": None}}))


def test_registration_check_passes_runs_after_it_and_names_every_other(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "examples").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    before = _commit(repo, "code, no spec yet")
    spec = repo / "examples" / "study.yaml"
    spec.write_text("name: s\nclaims: registered\n")
    registered = _commit(repo, "registration")
    (repo / "code.py").write_text("x = 2\n")
    later = _commit(repo, "a later change that keeps the spec")
    results = repo / "results"
    _summary(results, "a-seed1", registered)
    _summary(results, "b-seed2", later)
    assert main(["registration", str(results), "--spec", str(spec)]) == 0
    out = capsys.readouterr().out
    assert f"first committed in {registered[:12]}" in out and "2 of 2 runs ran from a clean commit" in out

    _summary(results, "c-seed3", before)
    _summary(results, "d-seed4", registered, dirty=True)
    _summary(results, "e-seed5", None)
    spec.write_text("name: s\nclaims: changed after the runs\n")
    changed = _commit(repo, "claims edited")
    _summary(results, "f-seed6", changed)
    spec.write_text("name: s\nclaims: registered\n")  # the registered text again, for the check below
    assert main(["registration", str(results), "--spec", str(spec)]) == 1
    out = capsys.readouterr().out
    assert f"c-seed3: commit {before[:12]} does not hold examples/study.yaml" in out
    assert f"d-seed4: ran from a tree with uncommitted changes at {registered[:12]}" in out
    assert "e-seed5: its summary records no code commit" in out
    assert f"f-seed6: commit {changed[:12]} holds another version of examples/study.yaml" in out
    assert "2 of 6 runs" in out


def test_an_uncommitted_spec_is_refused_in_one_line(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a").write_text("a")
    _commit(repo, "init")
    spec = repo / "study.yaml"
    spec.write_text("name: s\n")
    (repo / "results").mkdir()
    assert main(["registration", str(repo / "results"), "--spec", str(spec)]) == 2
    assert "git has never held this spec; commit the registration before any run" in capsys.readouterr().err
