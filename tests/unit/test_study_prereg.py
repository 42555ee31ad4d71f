"""Study specs with pre-registered claims, restricted grids (setting_losses), optimizer variants, and the pilot's
decision rule (stalerl_study.cli, stalerl_study.pilot)."""

from __future__ import annotations

import copy

import pytest
import yaml

from conftest import REPO
from stalerl_study.pilot import check_pilot
from stalerl_study.report import group, render_markdown
from stalerl_study.metrics import CollapseRule
from stalerl_study.cli import StudyError, _grid, check_settings, expand, load_spec

STUDY = REPO / "examples" / "math" / "study"


def _write(tmp_path, spec: dict):
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return p


def test_chain_specs_run_on_policy_once_and_name_only_cells_they_run(tmp_path):
    spec = load_spec(STUDY / "chain_staleness.yaml")
    runs = expand(spec)
    assert len(runs) == 8 * (1 + 3)
    assert [r["method"] for r in runs if r["setting"] == "fixed_staleness 0"] == ["vanilla"] * 8
    assert ["vanilla", "fixed_staleness 0"] in _grid(spec) and ["m2po", "fixed_staleness 0"] not in _grid(spec)
    raw = yaml.safe_load((STUDY / "chain_staleness.yaml").read_text())
    bad = copy.deepcopy(raw)
    bad["claims"]["list"][0]["b"] = "m2po @ fixed_staleness 0"  # on-policy m2po is never run
    with pytest.raises(StudyError, match="names 'm2po @ fixed_staleness 0', which the grid does not run"):
        load_spec(_write(tmp_path, bad))
    bad = copy.deepcopy(raw)
    bad["claims"]["list"][2].pop("margin")
    with pytest.raises(StudyError, match="needs a margin > 0"):
        load_spec(_write(tmp_path, bad))
    bad = copy.deepcopy(raw)
    bad["setting_losses"] = {"fixed_staleness 0": ["sgd"]}
    with pytest.raises(StudyError, match="setting_losses"):
        load_spec(_write(tmp_path, bad))


def test_pilot_variants_are_labelled_as_their_runs_report_them(tmp_path):
    spec = load_spec(STUDY / "chain_pilot.yaml")
    runs = expand(spec)
    assert len(runs) == 2 * 2 * 2  # 2 optimizer variants x {on-policy, no trust region at S 64} x 2 seeds
    spec["seeds"] = [1]
    assert len(check_settings(spec, expand(spec))) == 4  # labels and setting names are what the runs report
    spec["variants"] = {"lr=3e-4": ["actor.optimizer.lr=3e-4", "actor.optimizer.gradient_clipping=1.0"]}
    with pytest.raises(StudyError, match="reports method 'loss=vanilla, lr=0.0003, gradient_clipping=1.0'"):
        check_settings(spec, expand(spec)[:1])


def _run(loss: str, method: str, setting: str, seed: int, curve, status: str = "finished") -> dict:
    return {"schema": 2, "run": f"{method}-{setting}-{seed}", "status": status, "seed": seed, "loss": loss,
            "method": method, "setting": setting, "steps_planned": 300, "eval_every": 25,
            "curves": {"eval/accuracy": [[s, v] for s, v in curve]}}


def test_pilot_rule_reads_only_no_trust_region_and_on_policy():
    from stalerl_study.pilot import decide

    steps = range(0, 301, 25)
    rise = [(s, 0.2 + s / 1000) for s in steps]
    boom = [(s, 0.2 + s / 500 if s <= 150 else 0.1) for s in steps]  # prospers to 0.5, then falls to 0.1
    runs = []
    for seed in (1, 2):
        runs += [_run("vanilla", "loss=vanilla, lr=a", "fixed_staleness 0", seed, rise),
                 _run("vanilla", "loss=vanilla, lr=b", "fixed_staleness 0", seed, rise),
                 _run("no_trust_region", "loss=no_trust_region, lr=a", "fixed_staleness 64", seed, rise),
                 _run("no_trust_region", "loss=no_trust_region, lr=b", "fixed_staleness 64", seed, boom),
                 # an m2po run that collapses must not change anything: the rule never reads it
                 _run("m2po", "loss=m2po, lr=a", "fixed_staleness 64", seed, boom)]
    runs[-2]["curves"]["eval/accuracy"] = [[0, 0.2], [25, 0.3]]
    runs[-2]["status"] = "diverged"  # seed 2 of lr=b diverges instead: still a collapse
    cells = group(runs, method_keys=["method"])
    rows, chosen = decide(cells, {"stale_loss": "no_trust_region", "on_policy": "fixed_staleness 0",
                                  "prosper": 0.05}, CollapseRule())
    assert chosen == "lr=b @ fixed_staleness 64"
    assert [r[0] for r in rows] == ["lr=a @ fixed_staleness 64", "lr=b @ fixed_staleness 64"]
    assert rows[0][-1] == "no" and rows[1][1:] == ["2/2", "2/2", "0/2", "yes"]
    for r in runs:  # on-policy collapses too: no regime qualifies (a negative result)
        if r["loss"] == "vanilla" and r["method"].endswith("lr=b"):
            r["curves"]["eval/accuracy"] = [[s, v] for s, v in boom]
    assert decide(group(runs, method_keys=["method"]), {}, CollapseRule())[1] is None
    md = render_markdown(group(runs, method_keys=["method"]), study="p", pilot={"prosper": 0.05})
    assert "No regime qualifies: a negative result" in md
    assert "| lr=b @ fixed_staleness 64 | 2/2 | 2/2 | 2/2 | no |" in md
    with pytest.raises(ValueError, match="pilot.prosper"):
        check_pilot({"prosper": 5})


def test_stalerl_study_pilot_prints_the_decision(tmp_path, capsys):
    import json

    from stalerl_study.cli import main

    steps = range(0, 401, 50)
    for seed in (1, 2):
        for loss, setting, curve in (("vanilla", "fixed_staleness 0", [(s, 0.3 + s / 2000) for s in steps]),
                                     ("no_trust_region", "fixed_staleness 64",
                                      [(s, 0.3 + s / 1000 if s <= 150 else 0.1) for s in steps])):
            run = _run(loss, "", setting, seed, curve)
            run.update({"lr": 0.001, "gradient_clipping": 1.0, "run": f"{loss}-{seed}"})
            (tmp_path / f"{loss}-{seed}.json").write_text(json.dumps(run))
    spec = yaml.safe_load((STUDY / "chain_pilot.yaml").read_text())
    spec_path = _write(tmp_path / "spec", spec) if (tmp_path / "spec").mkdir() is None else None
    assert main(["pilot", str(tmp_path), "--spec", str(spec_path)]) == 0
    out = capsys.readouterr().out
    assert "| lr=0.001, gradient_clipping=1.0 @ fixed_staleness 64 | 2/2 | 2/2 | 0/2 | yes |" in out
    assert "Chosen regime: lr=0.001, gradient_clipping=1.0 @ fixed_staleness 64" in out
    assert main(["pilot", str(tmp_path), "--spec", str(STUDY / "chain_staleness.yaml")]) == 2  # no pilot rule


def test_degrade_pilot_picks_the_smallest_staleness_where_clip_falls_behind_a_task_that_keeps_learning():
    """The ``degrade`` kind (issue 47): on-policy must start in the step-0 range and keep learning past
    ``learns_until``; clip at S must trail it by ``degrade`` on average and in every seed; M2PO is never read."""
    from stalerl_study.pilot import decide, render_pilot

    steps = range(0, 101, 10)
    pilot = {"kind": "degrade", "stale_loss": "vanilla", "on_policy": "fixed_staleness 0", "step0": [0.05, 0.4],
             "prosper": 0.05, "learns_until": 60, "degrade": 0.05}

    def grid(on_curve, s16_drop, s32_drop):
        runs = []
        for seed in (1, 2, 3):
            on = [(s, v + 0.01 * seed) for s, v in on_curve]
            runs += [_run("vanilla", "vanilla", "fixed_staleness 0", seed, on),
                     _run("vanilla", "vanilla", "fixed_staleness 16", seed, [(s, v - s16_drop * s / 100) for s, v in on]),
                     _run("vanilla", "vanilla", "fixed_staleness 32", seed, [(s, v - s32_drop * s / 100) for s, v in on]),
                     _run("m2po", "m2po", "fixed_staleness 16", seed, [(s, 0.0) for s, _ in on])]
        return group(runs, method_keys=["method"])

    rising = [(s, 0.2 + s / 400) for s in steps]  # best at the last step (100)
    rows, chosen = decide(grid(rising, 0.02, 0.2), pilot, CollapseRule())
    assert [r[0] for r in rows] == ["default @ fixed_staleness 16", "default @ fixed_staleness 32"]
    assert rows[0][1:3] == ["3/3", "3/3"] and rows[0][-1] == "no"  # trails by 0.018: under the 0.05 margin
    assert rows[1][3] == "+0.180" and rows[1][4] == "3/3" and rows[1][-1] == "yes"
    assert chosen == "default @ fixed_staleness 32"
    assert decide(grid(rising, 0.1, 0.2), pilot, CollapseRule())[1] == "default @ fixed_staleness 16"  # the smaller S
    plateau = [(s, min(0.2 + s / 100, 0.5)) for s in steps]  # best first reached at step 30: stopped learning
    rows, chosen = decide(grid(plateau, 0.2, 0.2), pilot, CollapseRule())
    assert chosen is None and rows[0][2] == "0/3"
    too_easy = [(s, 0.6 + s / 1000) for s in steps]
    rows, chosen = decide(grid(too_easy, 0.2, 0.2), pilot, CollapseRule())
    assert chosen is None and rows[0][1] == "0/3"
    md = render_pilot(grid(rising, 0.02, 0.03), pilot)
    assert "No regime qualifies: a negative result. Per regime, what failed" in md
    assert ("- default @ fixed_staleness 16: failed: vanilla trailed on-policy by +0.018 on average (last3), in 3/3 "
            "seeds (needs >= 0.05 and every seed); held: on-policy step-0") in md
    md = render_pilot(grid(plateau, 0.2, 0.2), pilot)  # the task failed, the degradation held: both said
    assert ("fixed_staleness 32: failed: on-policy first reached its best at step >= 60 in 0/3 seeds; held: "
            "on-policy step-0 accuracy in [0.05, 0.4] in 3/3 seeds; vanilla trailed on-policy by") in md
    for bad, key in (({"kind": "sideways"}, "pilot.kind"), ({"kind": "degrade", "step0": [0.5, 0.1]}, "pilot.step0"),
                     ({"kind": "degrade", "learns_until": -1}, "pilot.learns_until"),
                     ({"kind": "degrade", "degrade": 2}, "pilot.degrade"), ({"step0": [0, 1]}, "step0")):
        with pytest.raises(ValueError, match=key):
            check_pilot(bad)


def test_a_pilot_with_runs_still_to_finish_is_not_decided():
    """Part of the grid in (a session's end stopped the stale runs; the last setting has not started): the block says
    how many runs are in and which cells are short, never 'no regime qualifies'."""
    steps = range(0, 81, 20)
    rise = [(s, 0.27 + s / 400) for s in steps]
    runs = [_run("vanilla", "vanilla", "fixed_staleness 0", seed, rise) for seed in (1, 2)]
    runs += [_run("vanilla", "vanilla", "fixed_staleness 16", seed, rise[:3], status="interrupted") for seed in (1, 2)]
    pilot = {"kind": "degrade", "stale_loss": "vanilla", "on_policy": "fixed_staleness 0"}
    cells = group(runs, method_keys=["loss"], seeds=[1, 2])
    md = render_markdown(cells, study="p", pilot=pilot)
    assert "No regime qualifies" not in md and "Chosen regime" not in md
    assert "Rule not applied yet: 2 of 4 runs collected; not finished: vanilla @ fixed_staleness 16 (2 of 2)" in md
    runs[2:] = [{**r, "status": "finished", "curves": {"eval/accuracy": [[s, v] for s, v in rise]}} for r in runs[2:]]
    md = render_markdown(group(runs, method_keys=["loss"], seeds=[1, 2]), study="p", pilot=pilot)
    assert "Rule not applied yet" not in md and "No regime qualifies: a negative result" in md
