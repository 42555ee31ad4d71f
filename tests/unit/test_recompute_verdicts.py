"""scripts/recompute_verdicts.py: an independent (standard library only) recomputation of a study's verdicts from
its committed summaries agrees with every verdict the docs print, and notices one that does not."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil

import pytest

from conftest import REPO

SPEC = importlib.util.spec_from_file_location("recompute_verdicts", REPO / "scripts" / "recompute_verdicts.py")
rv = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(rv)
DOC = REPO / "docs" / "algorithms" / "m2po.md"
RESULTS = REPO / "docs" / "algorithms" / "results"


def _registered() -> list[str]:
    return sorted(d.name for d in RESULTS.iterdir() if (d / "study.json").is_file()
                  and isinstance(json.loads((d / "study.json").read_text()).get("claims"), dict))


def test_the_script_imports_nothing_of_the_project():
    text = (REPO / "scripts" / "recompute_verdicts.py").read_text()
    assert "stalerl" not in "".join(line for line in text.splitlines() if line.startswith(("import", "from")))


@pytest.mark.parametrize("name", _registered())
def test_every_committed_verdict_recomputes(name, capsys):
    assert rv.main([str(RESULTS / name), "--doc", str(DOC)]) == 0
    out = capsys.readouterr().out
    assert "verdicts agree" in out and " 0 of " not in out


def test_a_doc_verdict_that_differs_is_reported(tmp_path, capsys):
    name = "chain_staleness"
    mine = rv.recompute(RESULTS / name)
    cid, verdict = next(iter(mine.items()))
    other = "not shown" if verdict != "not shown" else "holds"
    doc = tmp_path / "m2po.md"
    text = DOC.read_text()
    begin = text.index(f"<!-- results:begin {name} -->")
    row = text.index(f"\n| {cid}: ", begin) + 1  # the claim's row, not the paired table's tags
    end = text.index("\n", row)
    doc.write_text(text[:row] + text[row:end].replace(f"**{verdict}**", f"**{other}**") + text[end:])
    assert rv.main([str(RESULTS / name), "--doc", str(doc)]) == 1
    assert f"DIFFERS {cid}" in capsys.readouterr().err


def test_the_statistics_agree_with_the_reports_on_random_inputs():
    from stalerl_study.stats import fisher_greater, holm_adjust, t_sf

    rng = random.Random(5)
    for _ in range(40):
        t, df = rng.uniform(-6, 6), rng.randint(1, 30)
        assert rv.t_tail(t, df) == pytest.approx(t_sf(t, df), abs=1e-7)
    for _ in range(40):
        ps = [rng.random() ** 3 if rng.random() > 0.2 else None for _ in range(rng.randint(1, 7))]
        assert rv.holm(ps) == pytest.approx(holm_adjust(ps)) if any(p is not None for p in ps) else True
    for _ in range(40):
        na, nb = rng.randint(1, 10), rng.randint(1, 10)
        ka, kb = rng.randint(0, na), rng.randint(0, nb)
        assert rv.fisher_more(ka, na, kb, nb) == pytest.approx(fisher_greater(ka, na, kb, nb))


def test_secondary_claims_are_their_own_family(tmp_path):
    """A copy of chain_staleness with one claim marked secondary: the script adjusts it alone, like the report."""
    from stalerl_study.prereg import evaluate, parse_claims
    from stalerl_study.report import group, load_summaries

    copy = tmp_path / "chain_staleness"
    shutil.copytree(RESULTS / "chain_staleness", copy)
    study = json.loads((copy / "study.json").read_text())
    study["claims"]["list"][-1]["secondary"] = True
    study["claims"]["list"][-2]["secondary"] = True
    (copy / "study.json").write_text(json.dumps(study))
    mine = rv.recompute(copy)
    theirs = {r.claim.id: r.verdict for r in evaluate(group(load_summaries([copy])), parse_claims(study["claims"]))}
    assert mine == theirs
