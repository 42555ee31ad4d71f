"""stalerl_study.report, .stats and .cli over stalerl.results.run_summary: the multi-seed study pipeline on synthetic
run directories."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from conftest import CPU_CONFIG, REPO, small_overrides
from stalerl.config import load_config
from stalerl_study.report import build, group, load_summaries, main as report_main, replace_block
from stalerl_study.stats import format_estimate, mean_interval, t_quantile_975
from stalerl.results.run_summary import build_summary, downsample, setting_of, summarize_metrics, write_summary


# ------------------------------------------------------------------------------------------------ intervals
def _t_cdf_literal(q: float, df: int, n: int = 200_000) -> float:
    """P(T <= q) by Simpson's rule on Student's t density (a slow, literal reference)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    h = q / n
    s = f(0) + f(q) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return 0.5 + s * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 4, 9, 29, 30, 31, 45, 100])
def test_t_quantile_matches_literal_integration(df):
    assert _t_cdf_literal(t_quantile_975(df), df) == pytest.approx(0.975, abs=2e-5)


def test_mean_interval_against_literal_arithmetic():
    xs = [0.1, 0.3, 0.2, 0.5, 0.4]
    mean = sum(xs) / 5
    s = math.sqrt(sum((x - mean) ** 2 for x in xs) / 4)
    est = mean_interval(xs)
    assert est.mean == pytest.approx(0.3)
    assert est.half_width == pytest.approx(2.776445 * s / math.sqrt(5), rel=1e-6)
    assert format_estimate(est) == "0.300 ± 0.196"
    one = mean_interval([0.42])
    assert one.half_width is None and format_estimate(one) == "0.420 (n=1)"
    assert format_estimate(mean_interval([])) == "-"
    assert format_estimate(mean_interval([0.2, 0.2])) == "0.200 ± 0.000"


# ------------------------------------------------------------------------------------------------ summaries
def _metrics(steps: int, acc_end: float, reward_scale: float, staleness: int) -> list[dict]:
    rows = [{"step": 0, "warm_start/steps": 10.0, "warm_start/final_loss": 0.5, "eval/accuracy": 0.1}]
    for s in range(1, steps + 1):
        hist = [0] * staleness + [32]
        rows.append({"step": s, "reward": reward_scale * s / steps, "reward/consumed": reward_scale * s / steps,
                     "reward/generated": reward_scale * (s + staleness) / steps, "actor/grad_norm": 1.0 + s % 3,
                     "staleness/avg": float(staleness), "staleness/max": float(staleness), "staleness/hist": hist,
                     "actor/m2po/masked_fraction": 0.01, "timing/step_s": 0.5})
        if s % 5 == 0:
            rows.append({"step": s, "eval/accuracy": acc_end * s / steps})
    return rows


def _summary(tmp_path: Path, loss: str, seed: int, stale: int, acc: float, *, status: str = "finished",
             error: str | None = None, extra: tuple = ()) -> dict:
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path), f"actor.loss={loss}", f"seed={seed}",
                       f"rollout.fixed_staleness={stale}", f"trial_name={loss}-s{stale}-seed{seed}", *extra])
    return build_summary(cfg, status=status, wall_s=12.5, error=error, rows=_metrics(20, acc, 0.5, stale))


def _write_runs(root: Path, summaries: list[dict]) -> Path:
    for s in summaries:
        write_summary(root / s["run"] / "summary.json", s)
    return root


def test_summary_fields_from_metrics(tmp_path):
    s = _summary(tmp_path, "m2po", 1, 4, 0.8)
    assert (s["status"], s["seed"], s["loss"], s["setting"], s["dXdY"], s["rollout_R"]) == (
        "finished", 1, "m2po", "fixed_staleness 4", "d1+d1", 8)
    assert s["eval"] == {"initial": 0.1, "final": 0.8, "final_step": 20, "best": 0.8, "best_step": 20}
    assert s["reward"]["consumed"] == {"first": 0.0375, "last": 0.4875, "steps": 2}  # means of steps 1-2, 19-20
    assert s["reward"]["generated"]["last"] == pytest.approx(0.5 * (19.5 + 4) / 20)
    assert s["staleness"] == {"mean": 4.0, "max": 4, "hist": [0, 0, 0, 0, 32 * 20]}
    assert s["fractions"] == {"m2po/masked_fraction": 0.01}
    assert s["grad_norm"]["max"] == 3.0
    assert s["warm_start"] == {"steps": 10.0, "final_loss": 0.5}
    assert s["machine"]["cores"] and s["machine"]["torch"]
    # the ISA decides the kernels and so the trajectory: named, with the capability ATen was asked for
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")),
                 []) if cpuinfo.exists() else []
    assert s["machine"]["cpu_isa"] == [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    assert s["machine"]["aten_cpu_capability"] == (os.environ.get("ATEN_CPU_CAPABILITY") or "default")
    # Seeds of one setting share setting_digest; another loss does not.
    assert _summary(tmp_path, "m2po", 2, 4, 0.8)["setting_digest"] == s["setting_digest"]
    assert _summary(tmp_path, "vanilla", 1, 4, 0.8)["setting_digest"] != s["setting_digest"]
    assert _summary(tmp_path, "m2po", 2, 4, 0.8)["config_digest"] != s["config_digest"]


@pytest.fixture
def same_code(monkeypatch):
    """One fixed code state for summaries and the study runner alike: a study reuses only runs of the same commit
    and uncommitted changes, and the real checkout may change under a test (others editing it)."""
    from stalerl.results import run_summary

    state = {"commit": "c0de" * 10, "dirty": False, "dirty_digest": None}
    monkeypatch.setattr(run_summary, "code_state", lambda root=None: dict(state))
    return state


def test_downsample_is_bounded_and_keeps_the_last_step():
    pts = [(i, float(i)) for i in range(1, 301)]
    d = downsample(pts, 60)
    assert len(d) == 60 and d[-1] == [300, 298.0] and d[0] == [5, 3.0]
    assert downsample(pts[:10], 60) == [[i, float(i)] for i in range(1, 11)]
    assert len(summarize_metrics(_metrics(300, 0.5, 1.0, 0))["curves"]["reward/consumed"]) == 60


def test_areal_setting_names():
    def d(**ro):
        base = {"backend": "hf:d1", "max_concurrent_rollouts": None, "consumer_batch_size": 32, "fixed_staleness": 0,
                "max_head_offpolicyness": 0, "mode": "auto"}
        return {"rollout": {**base, **ro}, "actor": {"backend": "torch:d1"}}

    assert setting_of(d(max_head_offpolicyness=16, backend="hf:d2", max_concurrent_rollouts=64))["setting"] == \
        "stale 16 d2+d1 rollout 64"
    assert setting_of(d(max_head_offpolicyness=4))["setting"] == "stale 4 d1+d1 rollout 32"  # R = batch size
    assert setting_of(d(fixed_staleness=4))["setting"] == "fixed_staleness 4"
    assert setting_of(d())["mode"] == "sync"


# ------------------------------------------------------------------------------------------------ report
def _grid(tmp_path: Path) -> Path:
    out = []
    for loss in ("m2po", "vanilla"):
        for seed in (1, 2, 3):
            if loss == "vanilla" and seed == 3:
                continue  # missing
            status, err = ("failed", "RuntimeError: boom") if (loss, seed) == ("vanilla", 2) else ("finished", None)
            out.append(_summary(tmp_path, loss, seed, 4, 0.3 + 0.1 * seed, status=status, error=err))
    return _write_runs(tmp_path / "runs", out)


def _row(block: str, setting: str, method: str) -> list[str]:
    for line in block.splitlines():
        cols = [c.strip() for c in line.strip("|").split("|")]
        if cols[:2] == [setting, method]:
            return cols
    raise AssertionError(f"no row {setting} / {method} in\n{block}")


def test_report_means_intervals_missing_and_failed(tmp_path):
    root = _grid(tmp_path)
    block, figs = build([root], study="toy", seeds=[1, 2, 3], figures=False)
    m2po = _row(block, "fixed_staleness 4", "m2po")
    assert m2po[2] == "3/3"
    assert m2po[3] == format_estimate(mean_interval([0.4, 0.5, 0.6]))  # final eval accuracy
    assert m2po[-1] == "-"
    vanilla = _row(block, "fixed_staleness 4", "vanilla")
    assert vanilla[2] == "1/3"
    assert vanilla[3] == "0.400 (n=1)"
    assert vanilla[-1] == "seed 2 failed (RuntimeError: boom); missing seed 3"
    assert "Student-t" in block
    # A cell whose every run failed is shown as failed, not dropped.
    only_failed = [s for s in load_summaries([root]) if s["loss"] == "vanilla" and s["seed"] == 2]
    cells = group(only_failed, seeds=[2])
    assert [c.value("eval.final") for c in cells] == ["failed"]


def test_report_update_doc_is_byte_exact_and_checkable(tmp_path):
    pytest.importorskip("matplotlib")
    root = _grid(tmp_path)
    results = tmp_path / "docs" / "results" / "toy"
    results.mkdir(parents=True)
    for f in root.rglob("summary.json"):  # collected like stalerl-study does
        shutil.copy(f, results / f"{f.parent.name}.json")
    (results / "study.json").write_text(json.dumps({"name": "toy", "title": "Toy", "seeds": [1, 2, 3],
                                                    "settings": ["fixed_staleness 4"], "methods": ["vanilla", "m2po"],
                                                    "wall_s": 90.0, "command": "stalerl-study run toy.yaml"}))
    doc = tmp_path / "docs" / "m2po.md"
    doc.write_text("# Doc\n\nbefore\n<!-- results:begin toy -->\nold\n<!-- results:end toy -->\nafter\n")
    assert report_main([str(results), "--update-doc", str(doc)]) == 0
    first = doc.read_bytes()
    text = first.decode()
    assert text.startswith("# Doc\n\nbefore\n<!-- results:begin toy -->\n### Toy\n") and text.endswith(
        "<!-- results:end toy -->\nafter\n")
    assert "](results/toy/toy_eval_accuracy.png)" in text and (results / "toy_eval_accuracy.png").is_file()
    assert text.index("| fixed_staleness 4 | vanilla") < text.index("| fixed_staleness 4 | m2po")  # study order
    assert "wall time of the table: 1.5 min" in text
    assert report_main([str(results), "--update-doc", str(doc), "--check"]) == 0
    # Regenerating from a fresh copy of the committed summaries gives the same bytes.
    copy = tmp_path / "clone"
    shutil.copytree(tmp_path / "docs", copy)
    copy_doc = copy / "m2po.md"
    copy_doc.write_text(copy_doc.read_text().replace("### Toy", "### Edited by hand"))
    assert report_main([str(copy / "results" / "toy"), "--update-doc", str(copy_doc), "--check"]) == 1
    assert report_main([str(copy / "results" / "toy"), "--update-doc", str(copy_doc)]) == 0
    assert copy_doc.read_bytes() == first
    # Changing a summary makes the committed block stale.
    f = next(results.glob("m2po-*seed1.json"))
    d = json.loads(f.read_text())
    d["eval"]["final"] = 0.99
    f.write_text(json.dumps(d))
    assert report_main([str(results), "--update-doc", str(doc), "--check"]) == 1


def test_report_errors_name_the_fix(tmp_path, capsys):
    with pytest.raises(ValueError, match="results:begin toy"):
        replace_block("no markers\n", "toy", "x\n")
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    assert "no run summaries" in capsys.readouterr().err


@pytest.mark.parametrize("study_json", sorted((REPO / "docs" / "algorithms" / "results").glob("*/study.json")),
                         ids=lambda p: p.parent.name)
def test_committed_results_regenerate_the_doc_exactly(study_json):
    """Every committed study block in docs/algorithms/m2po.md is what its committed summaries generate."""
    assert report_main([str(study_json.parent), "--update-doc", str(REPO / "docs" / "algorithms" / "m2po.md"),
                        "--check"]) == 0


# ------------------------------------------------------------------------------------------------ run summary hook
def test_failed_run_still_writes_a_failed_summary(tmp_path, monkeypatch):
    import stalerl.launch.launcher as launcher

    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path)])

    class Boom:
        def train(self):
            raise RuntimeError("rollout worker died")

    monkeypatch.setattr(launcher, "build_trainer", lambda cfg: Boom())
    with pytest.raises(RuntimeError):
        launcher.launch(cfg)
    from stalerl.config import run_dir

    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "failed" and s["error"] == "RuntimeError: rollout worker died"
    assert s["steps_done"] == 0 and s["eval"]["final"] is None


# ------------------------------------------------------------------------------------------------ study specs
def test_study_specs_expand_and_validate(tmp_path):
    from stalerl_study.cli import StudyError, check_settings, expand, load_spec

    spec = load_spec(REPO / "examples" / "math" / "study" / "staleness.yaml")
    runs = expand(spec)
    assert spec["losses"] == ["m2po", "vanilla", "no_trust_region"]
    assert len(runs) == (1 + 3 * 2) * 8 and len({r["trial"] for r in runs}) == len(runs)  # on-policy once
    spec = load_spec(REPO / "examples" / "math" / "study" / "async.yaml")
    assert list(spec["settings"]) == ["stale 16 d2+d1 rollout 64"]
    assert len(expand(spec)) == 2 * 8
    spec["seeds"], spec["losses"] = [1], ["m2po"]
    assert len(check_settings(spec, expand(spec))) == 1  # every name is what its runs report
    spec["settings"] = {"stale 16 d1+d1 rollout 64": spec["settings"]["stale 16 d2+d1 rollout 64"]}
    with pytest.raises(StudyError, match="rename it to 'stale 16 d2\\+d1 rollout 64'"):
        check_settings(spec, expand(spec))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nconfig: c.yaml\nlosses: [m2po]\nsettings: {a: []}\nseeds: [1]\nseedz: [2]\n")
    with pytest.raises(StudyError, match="unknown key\\(s\\) seedz"):
        load_spec(bad)
    spec = load_spec(REPO / "examples" / "math" / "study" / "chain_pilot.yaml")
    from stalerl_study.cli import _method_labels

    assert _method_labels(spec)[:2] == ["loss=vanilla, lr=0.0001, gradient_clipping=1.0",
                                        "loss=vanilla, lr=5e-05, gradient_clipping=1.0"]


# ------------------------------------------------------------------------------------------------ reward logging
@pytest.mark.parametrize("stale", [0, 2])
def test_generated_and_consumed_rewards_are_logged_apart(tmp_path, stale):
    """The batch consumed at step t+S is the one generated at step t (after the FIFO's first fill)."""
    from stalerl.results.metrics_log import read_metrics
    from stalerl.training.trainer import Trainer

    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, total_train_steps=7,
                                                                      **{"rollout.fixed_staleness": stale})])
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.train()
    rows = {r["step"]: r for r in read_metrics(trainer.run_dir) if r["step"] > 0 and "reward/consumed" in r}
    assert sorted(rows) == list(range(1, 8))
    assert all(r["reward"] == r["reward/consumed"] for r in rows.values())  # documented alias
    for t in range(2, 8 - stale):
        assert rows[t + stale]["reward/consumed"] == rows[t]["reward/generated"]


@pytest.mark.slow
def test_study_runner_on_a_tiny_grid(tmp_path):
    """Warm start once per seed, runs from the cached model, summaries collected, doc block written; the cached
    warm start gives exactly the run an in-run warm start gives."""
    from stalerl.launch.launcher import launch
    from stalerl.results.metrics_log import read_metrics
    from stalerl.config import run_dir
    from stalerl_study.cli import load_spec, run_study

    ovr = small_overrides(tmp_path, total_train_steps=4)
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(json.dumps({
        "name": "tiny", "config": str(CPU_CONFIG), "losses": ["m2po", "vanilla"], "seeds": [1, 2],
        "settings": {"fixed_staleness 2": ["rollout.fixed_staleness=2"]}, "overrides": ovr, "parallel": 2,
        "results": str(tmp_path / "docs" / "results" / "tiny"), "doc": str(tmp_path / "docs" / "m2po.md")}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "m2po.md").write_text("<!-- results:begin tiny -->\n<!-- results:end tiny -->\n")
    spec = load_spec(spec_file)
    assert run_study(spec, spec_path=str(spec_file)) == 0
    results = sorted(p.name for p in (tmp_path / "docs" / "results" / "tiny").glob("*.json"))
    assert results == ["m2po-fixed_staleness_2-seed1.json", "m2po-fixed_staleness_2-seed2.json", "study.json",
                       "vanilla-fixed_staleness_2-seed1.json", "vanilla-fixed_staleness_2-seed2.json"]
    assert len(list((tmp_path / "runs" / "warm_start").iterdir())) == 2  # once per seed
    doc = (tmp_path / "docs" / "m2po.md").read_text()
    assert "| fixed_staleness 2 | m2po | 2/2 |" in doc and "| fixed_staleness 2 | vanilla | 2/2 |" in doc
    summary = json.loads((tmp_path / "docs" / "results" / "tiny" / "m2po-fixed_staleness_2-seed1.json").read_text())
    assert summary["status"] == "finished" and summary["warm_start"]["steps"] == 10.0
    # The same run with its own warm start, directly.
    cfg = load_config(["--config", str(CPU_CONFIG), *ovr, "actor.loss=m2po", "rollout.fixed_staleness=2", "seed=1",
                       "trial_name=direct"])
    launch(cfg)
    direct = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert direct["setting_digest"] == summary["setting_digest"]
    keys = ("reward/consumed", "reward/generated", "actor/grad_norm", "eval/accuracy")
    cached_rows = read_metrics(run_dir(cfg).parent.parent / "study-tiny" / "m2po-fixed_staleness_2-seed1")
    pick = lambda rows: [[r.get(k) for k in keys] for r in rows]  # noqa: E731
    assert pick(read_metrics(run_dir(cfg))) == pick(cached_rows)
    # The spec is cut to one loss and run again (nothing to train): vanilla's summaries are set aside, not shown.
    spec_file.write_text(json.dumps({**json.loads(spec_file.read_text()), "losses": ["m2po"]}))
    assert run_study(load_spec(spec_file), spec_path=str(spec_file)) == 0
    res_dir = tmp_path / "docs" / "results" / "tiny"
    assert sorted(p.name for p in res_dir.glob("*.json")) == [
        "m2po-fixed_staleness_2-seed1.json", "m2po-fixed_staleness_2-seed2.json", "study.json"]
    assert sorted(p.name for p in res_dir.glob("superseded/*/*.json")) == [
        "vanilla-fixed_staleness_2-seed1.json", "vanilla-fixed_staleness_2-seed2.json"]
    doc = (tmp_path / "docs" / "m2po.md").read_text()
    assert "| fixed_staleness 2 | m2po | 2/2 |" in doc and "| vanilla |" not in doc


def test_a_study_in_a_fresh_checkout_skips_runs_whose_collected_summary_has_their_config(tmp_path, monkeypatch,
                                                                                          same_code):
    """Run directories are machine-local; the collected summaries are committed. A study resumed where its run
    directories are gone re-runs only what no collected summary of the very same config and code holds (finished or
    diverged), keeps the others as they were, and --force re-runs everything."""
    from stalerl_study import cli as study
    from stalerl_study.cli import collected_summary, expand, load_spec, run_study

    results = tmp_path / "results"
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps({
        "name": "resume", "config": str(CPU_CONFIG), "losses": ["m2po"], "seeds": [1, 2, 3, 4],
        "settings": {"fixed_staleness 2": ["rollout.fixed_staleness=2"]}, "warm_start_cache": False,
        "overrides": small_overrides(tmp_path, total_train_steps=4), "parallel": 1, "results": str(results),
        "doc": str(tmp_path / "m2po.md")}))
    spec = load_spec(spec_file)
    cfgs = {r["trial"]: load_config(["--config", str(CPU_CONFIG), *r["overrides"]]) for r in expand(spec)}
    t1, t2, t3, t4 = cfgs
    results.mkdir()
    write_summary(results / f"{t1}.json", build_summary(cfgs[t1], status="finished", wall_s=1.0, rows=[]))
    write_summary(results / f"{t2}.json", build_summary(cfgs[t2], status="diverged", wall_s=1.0, rows=[]))
    write_summary(results / f"{t3}.json", build_summary(cfgs[t3], status="failed", wall_s=1.0, rows=[]))
    other = load_config(["--config", str(CPU_CONFIG), *expand(spec)[3]["overrides"], "actor.optimizer.lr=0.5"])
    write_summary(results / f"{t4}.json", build_summary(other, status="finished", wall_s=1.0, rows=[]))
    kept = {t: (results / f"{t}.json").read_text() for t in (t1, t2)}
    assert collected_summary(results, t1, cfgs[t1])["status"] == "finished"
    assert collected_summary(results, t4, cfgs[t4]) is None  # another config under the same name: not this run

    ran: list[list[str]] = []
    monkeypatch.setattr(study, "_pool", lambda commands, parallel: (ran.append([n for n, _ in commands]),
                                                                    {n: 0 for n, _ in commands})[1])
    run_study(spec, spec_path=str(spec_file), report=False)
    assert ran == [[t3, t4]]  # the failed one and the other config's; nothing of this config that finished
    assert {t: (results / f"{t}.json").read_text() for t in (t1, t2)} == kept
    assert json.loads((results / f"{t4}.json").read_text())["status"] == "failed"  # no run wrote one (fake pool)
    ran.clear()
    run_study(spec, spec_path=str(spec_file), report=False, force=True)
    assert ran == [[t1, t2, t3, t4]]


def test_sigterm_passes_to_the_runs_in_flight_and_starts_no_other(tmp_path):
    """The study's pool, under run_study's signal handling: a SIGTERM reaches each running command once, the
    pending ones never start, and the pool returns as soon as the running ones have stopped."""
    import signal
    import sys
    import threading
    import time

    from stalerl.core.interrupt import StopRequests, polled
    from stalerl_study.cli import _pool

    child = ("import signal, sys, time, pathlib; p = pathlib.Path(sys.argv[1]); "
             "signal.signal(signal.SIGTERM, lambda *a: (p.write_text('stopped'), sys.exit(143))); "
             "p.write_text('started'); time.sleep(60)")
    commands = [(n, [sys.executable, "-c", child, str(tmp_path / n)]) for n in ("a", "b", "c")]
    killer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    t0 = time.monotonic()
    with StopRequests(), polled():
        killer.start()
        codes = _pool(commands, 2)
    assert time.monotonic() - t0 < 30
    assert codes == {"a": 143, "b": 143}
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == "stopped"
    assert not (tmp_path / "c").exists()


def test_an_interrupted_study_collects_the_finished_runs_and_resumes_the_rest(tmp_path, monkeypatch, same_code):
    """A signal during the grid: the finished runs' summaries are collected (with the wall time so far), the
    stopped and unstarted ones are not, the doc stays as it was, the exit is 128 + signal; the same command then
    runs only the rest and the table's wall time includes the first part."""
    import signal

    from stalerl.config import run_dir
    from stalerl_study import cli as study
    from stalerl_study.cli import expand, load_spec, run_study

    results, doc = tmp_path / "results", tmp_path / "m2po.md"
    doc.write_text("<!-- results:begin stop -->\n<!-- results:end stop -->\n")
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps({
        "name": "stop", "config": str(CPU_CONFIG), "losses": ["m2po"], "seeds": [1, 2, 3],
        "settings": {"fixed_staleness 2": ["rollout.fixed_staleness=2"]}, "warm_start_cache": False,
        "overrides": small_overrides(tmp_path, total_train_steps=4), "parallel": 1, "results": str(results),
        "doc": str(doc)}))
    spec = load_spec(spec_file)
    cfgs = {r["trial"]: load_config(["--config", str(CPU_CONFIG), *r["overrides"]]) for r in expand(spec)}
    t1, t2, t3 = cfgs
    ran: list[list[str]] = []

    def pool(commands, parallel, stop_after=None):
        ran.append([n for n, _ in commands])
        for n, _ in commands[:stop_after]:  # these finish; with a signal, the next one stops and no other starts
            run_dir(cfgs[n]).mkdir(parents=True, exist_ok=True)
            write_summary(run_dir(cfgs[n]) / "summary.json",
                          build_summary(cfgs[n], status="finished", wall_s=1.0, rows=[]))
        if stop_after is not None:
            n = commands[stop_after][0]
            run_dir(cfgs[n]).mkdir(parents=True, exist_ok=True)
            write_summary(run_dir(cfgs[n]) / "summary.json",
                          build_summary(cfgs[n], status="interrupted", wall_s=1.0, rows=[]))
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by run_study's handler, not raised
        return {n: 0 for n, _ in commands}

    monkeypatch.setattr(study, "_pool", lambda c, p: pool(c, p, stop_after=1))
    assert run_study(spec, spec_path=str(spec_file)) == 128 + signal.SIGTERM
    assert sorted(p.stem for p in results.glob("*.json")) == sorted(["study", t1])
    assert json.loads((results / f"{t1}.json").read_text())["status"] == "finished"
    first_wall = json.loads((results / "study.json").read_text())["wall_s"]
    assert doc.read_text() == "<!-- results:begin stop -->\n<!-- results:end stop -->\n"

    shutil.rmtree(run_dir(cfgs[t1]).parent)  # a fresh checkout: the run directories are gone
    monkeypatch.setattr(study, "_pool", lambda c, p: pool(c, p))
    assert run_study(spec, spec_path=str(spec_file), report=False) == 0
    assert ran[-1] == [t2, t3]
    assert all(json.loads((results / f"{t}.json").read_text())["status"] == "finished" for t in (t1, t2, t3))
    assert json.loads((results / "study.json").read_text())["wall_s"] >= first_wall


def test_a_resumed_study_refuses_other_kernels_and_warm_starts_only_seeds_with_runs_left(tmp_path, monkeypatch,
                                                                                          same_code):
    """Collected runs that used AVX512 kernels (the same config trains differently there) cannot be joined by runs
    on AVX2 kernels: refused in one line naming ATEN_CPU_CAPABILITY, before any warm start. With matching kernels
    only the seeds that still have a run get a warm start."""
    from stalerl_study import cli as study
    from stalerl_study.cli import StudyError, expand, load_spec, run_kernels, run_study
    from stalerl.results.run_summary import machine_description

    assert run_kernels({"cpu_isa": ["avx2", "avx512f"], "aten_cpu_capability": "default", "torch": "t"}) == \
        "avx512 kernels, torch t"
    assert run_kernels({"cpu_isa": ["avx2", "avx512f"], "aten_cpu_capability": "avx2", "torch": "t"}) == \
        "avx2 kernels, torch t"
    results = tmp_path / "results"
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps({
        "name": "k", "config": str(CPU_CONFIG), "losses": ["m2po"], "seeds": [1, 2],
        "settings": {"fixed_staleness 2": ["rollout.fixed_staleness=2"]},
        "overrides": small_overrides(tmp_path, total_train_steps=4), "parallel": 1, "results": str(results),
        "doc": str(tmp_path / "m2po.md")}))
    spec = load_spec(spec_file)
    assert load_config(["--config", str(CPU_CONFIG), *spec["overrides"]]).warm_start.steps > 0  # the cache is used
    (r1,) = [r for r in expand(spec) if r["seed"] == 1]
    cfg = load_config(["--config", str(CPU_CONFIG), *r1["overrides"]])
    cfg1 = load_config(["--config", str(CPU_CONFIG), *r1["overrides"], f"actor.path={study.warm_start_dir(cfg)}",
                        "warm_start.steps=0"])
    summary = build_summary(cfg1, status="finished", wall_s=1.0, rows=[])
    here = machine_description()
    results.mkdir()
    started: list[list[str]] = []
    monkeypatch.setattr(study, "_pool", lambda c, p: (started.append([n for n, _ in c]), {n: 0 for n, _ in c})[1])
    other = "avx2" if run_kernels(here).startswith("avx512") else "avx512"
    summary["machine"] = {**here, "aten_cpu_capability": other}
    write_summary(results / f"{r1['trial']}.json", summary)
    with pytest.raises(StudyError, match=f"used {other} kernels.*ATEN_CPU_CAPABILITY={other} stalerl-study run"):
        run_study(spec, spec_path=str(spec_file), report=False)
    assert started == []  # refused before any warm start
    summary["machine"] = here
    write_summary(results / f"{r1['trial']}.json", summary)
    run_study(spec, spec_path=str(spec_file), report=False)
    assert len(started[0]) == 1 and started[0][0].startswith("warm start seed2-")  # seed 1 has nothing left to run
    assert started[1] == [r["trial"] for r in expand(spec) if r["seed"] == 2]


def test_a_cut_invocation_keeps_the_summaries_of_the_spec_runs_it_did_not_run(tmp_path, monkeypatch):
    """`--seeds 2` runs seed 2 only; seed 1's collected summary is still a run of the spec: it stays (only runs the
    spec no longer lists are set aside)."""
    import argparse

    from stalerl_study import cli as study
    from stalerl_study.cli import apply_cli, load_spec, run_study

    results = tmp_path / "results"
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps({
        "name": "cut", "config": str(CPU_CONFIG), "losses": ["m2po"], "seeds": [1, 2],
        "settings": {"fixed_staleness 2": ["rollout.fixed_staleness=2"]}, "warm_start_cache": False,
        "overrides": small_overrides(tmp_path, total_train_steps=4), "parallel": 1, "results": str(results),
        "doc": str(tmp_path / "m2po.md")}))
    results.mkdir()
    for name in ("m2po-fixed_staleness_2-seed1", "gone-seed1"):
        (results / f"{name}.json").write_text(json.dumps(_fake("m2po", "s", 1, 0.5, 0.5) | {"run": name}))
    monkeypatch.setattr(study, "_pool", lambda c, p: {n: 0 for n, _ in c})
    cli = argparse.Namespace(seeds="2", losses=None, settings=None, set=[], results=None, doc=None, parallel=None,
                             experiment_name=None)
    run_study(apply_cli(load_spec(spec_file), cli), spec_path=str(spec_file), report=False)
    assert sorted(p.name for p in results.glob("*.json")) == [
        "m2po-fixed_staleness_2-seed1.json", "m2po-fixed_staleness_2-seed2.json", "study.json"]
    assert [p.name for p in results.glob("superseded/*/*.json")] == ["gone-seed1.json"]


def test_a_cut_invocation_records_the_whole_grid_and_adds_its_time_to_the_earlier_parts(tmp_path, monkeypatch,
                                                                                         same_code):
    """A grid run in parts (--settings / --seeds cuts, e.g. across sessions): study.json (read by the report) still
    describes the registered grid (seeds, settings, methods, on-policy row), its wall time is the sum of the parts,
    each part is listed with the command typed, and the block's Reproduce command is the whole table's (no cut)."""
    from stalerl_study import cli as study

    results = tmp_path / "results"
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps({
        "name": "parts", "config": str(CPU_CONFIG), "losses": ["vanilla", "m2po"], "seeds": [1, 2],
        "settings": {"fixed_staleness 0": ["rollout.fixed_staleness=0"],
                     "fixed_staleness 2": ["rollout.fixed_staleness=2"]},
        "setting_losses": {"fixed_staleness 0": ["vanilla"]}, "warm_start_cache": False,
        "overrides": small_overrides(tmp_path, total_train_steps=4), "parallel": 1, "results": str(results),
        "doc": str(tmp_path / "m2po.md")}))
    from stalerl.config import run_dir

    cfgs = {r["trial"]: load_config(["--config", str(CPU_CONFIG), *r["overrides"]])
            for r in study.expand(study.load_spec(spec_file))}
    results.mkdir()
    for trial, cfg in cfgs.items():  # the staleness-2 part, collected by an earlier invocation (before invocations)
        if "fixed_staleness_2" in trial:
            write_summary(results / f"{trial}.json", build_summary(cfg, status="finished", wall_s=1.0, rows=[]))
    (results / "study.json").write_text(json.dumps({"command": f"stalerl-study run {spec_file} --settings "
                                                               "'fixed_staleness 2'", "wall_s": 100.0, "runs": 4}))

    def pool(commands, parallel):  # each run "finishes" at once: its run directory holds a finished summary
        for name, _ in commands:
            write_summary(run_dir(cfgs[name]) / "summary.json",
                          build_summary(cfgs[name], status="finished", wall_s=1.0, rows=[]))
        return {n: 0 for n, _ in commands}

    monkeypatch.setattr(study, "_pool", pool)
    assert study.main(["run", str(spec_file), "--settings", "fixed_staleness 0", "--no-report"]) == 0
    meta = json.loads((results / "study.json").read_text())
    assert meta["seeds"] == [1, 2] and meta["settings"] == ["fixed_staleness 0", "fixed_staleness 2"]
    assert meta["methods"] == ["vanilla", "m2po"] and meta["runs"] == 6
    assert sorted(map(tuple, meta["grid"])) == [("m2po", "fixed_staleness 2"), ("vanilla", "fixed_staleness 0"),
                                                 ("vanilla", "fixed_staleness 2")]
    assert meta["command"] == f"stalerl-study run {spec_file}"
    assert [(i["command"].split("--settings ")[-1], i["runs"]) for i in meta["invocations"]] == [
        ("'fixed_staleness 2'", 4), ("'fixed_staleness 0'", 2)]
    assert 100.0 <= meta["wall_s"] == round(100.0 + meta["invocations"][-1]["wall_s"], 1)
    # Run again with nothing left to do: no new part, the time unchanged. --force on the whole grid: only its time.
    assert study.main(["run", str(spec_file), "--no-report"]) == 0
    again = json.loads((results / "study.json").read_text())
    assert again["invocations"] == meta["invocations"] and abs(again["wall_s"] - meta["wall_s"]) < 1.0
    assert study.main(["run", str(spec_file), "--force", "--no-report"]) == 0
    forced = json.loads((results / "study.json").read_text())
    assert forced["wall_s"] < 100.0 and [i["runs"] for i in forced["invocations"]] == [6]


def test_summaries_of_runs_a_spec_no_longer_lists_are_moved_aside_never_lost(tmp_path):
    from stalerl_study.cli import set_aside_other_summaries

    res = tmp_path / "results"
    res.mkdir()
    for name in ("keep-seed1", "old-seed1", "old-seed2"):
        (res / f"{name}.json").write_text(json.dumps(_fake("m2po", "s", 1, 0.5, 0.5) | {"run": name}))
    (res / "study.json").write_text("{}")
    (res / "notes.json").write_text(json.dumps({"not": "a summary"}))
    (res / "broken.json").write_text("{")
    moved = set_aside_other_summaries(res, {"keep-seed1"})
    assert sorted(p.name for p in moved) == ["old-seed1.json", "old-seed2.json"]
    assert all(p.is_file() and p.parent.parent == res / "superseded" for p in moved)
    assert sorted(p.name for p in res.glob("*.json")) == ["broken.json", "keep-seed1.json", "notes.json", "study.json"]
    assert [d["run"] for d in load_summaries([res])] == ["keep-seed1"]  # the report never reads superseded/
    assert [d["run"] for d in load_summaries([tmp_path])] == ["keep-seed1"]  # nor from a directory above
    # A run directory that is merely called "superseded" is a run like any other.
    (tmp_path / "runs" / "superseded").mkdir(parents=True)
    (tmp_path / "runs" / "superseded" / "summary.json").write_text(json.dumps(_fake("m2po", "s", 1, 0.5, 0.5)))
    assert len(load_summaries([tmp_path / "runs"])) == 1
    # A second cut in the same second gets its own folder: the first one's files are not overwritten.
    (res / "old-seed1.json").write_text(json.dumps(_fake("m2po", "s", 1, 0.1, 0.1) | {"run": "old-seed1"}))
    again = set_aside_other_summaries(res, {"keep-seed1"})
    assert len(again) == 1 and again[0].parent != moved[0].parent
    assert json.loads(moved[0].read_text())["eval"]["final"] == 0.5
    assert set_aside_other_summaries(res, {"keep-seed1"}) == []


# ------------------------------------------------------------------------------------------------ claims
def _fake(loss: str, setting: str, seed: int, final: float, best: float, frac: float = 0.0, gn: float = 1.0) -> dict:
    key = "m2po/masked_fraction" if loss == "m2po" else "vanilla/clip_fraction"
    return {"schema": 1, "run": f"{loss}-{setting}-{seed}", "status": "finished", "seed": seed, "loss": loss,
            "setting": setting, "eval": {"final": final, "best": best}, "fractions": {key: frac},
            "grad_norm": {"mean": gn}}


def test_staleness_claims_verdicts():
    from stalerl_study.claims import render_claims

    rows = []
    for seed, eps in ((1, -0.01), (2, 0.0), (3, 0.01)):
        rows += [_fake("m2po", "fixed_staleness 0", seed, 0.5 + eps, 0.5 + eps),
                 _fake("vanilla", "fixed_staleness 0", seed, 0.5 + eps, 0.5 + eps),
                 _fake("no_trust_region", "fixed_staleness 0", seed, 0.5 + eps, 0.5 + eps),
                 _fake("m2po", "fixed_staleness 16", seed, 0.5 + 2 * eps, 0.52, frac=0.001 + eps / 100),
                 _fake("vanilla", "fixed_staleness 16", seed, 0.2 + eps, 0.3, frac=0.02 + eps / 100),
                 _fake("no_trust_region", "fixed_staleness 16", seed, 0.1 + eps, 0.6 + eps)]
    text = "\n".join(render_claims(group(rows), "staleness"))
    assert ("Clip (vanilla/GRPO) degrades with staleness (final eval below on-policy vanilla): "
            "**holds** at fixed_staleness 16 (") in text
    assert "No trust region prospers then collapses (best minus final eval above 0): " \
           "**holds** at fixed_staleness 16 (drop 0.500 ± 0.000)" in text
    assert ("M2PO tracks on-policy (final eval not below on-policy M2PO): **consistent** at fixed_staleness 16 "
            "(fixed_staleness 16: stale 0.500 ± 0.050 vs on-policy 0.500 ± 0.025, paired difference 0.000 ± 0.025, "
            "stale higher in 1/3 seeds)") in text
    assert ("M2PO's final eval is higher than clip's (vanilla/GRPO) at the same staleness: "
            "**holds** at fixed_staleness 16") in text
    assert ("M2PO masks fewer tokens than clip clips: **holds** at "
            "fixed_staleness 16") in text
    # M2PO far below on-policy -> does not hold; one seed only -> inconclusive.
    worse = [dict(r, eval={"final": 0.1 + r["seed"] / 100, "best": 0.2}) if (r["loss"], r["setting"]) == (
        "m2po", "fixed_staleness 16") else r for r in rows]
    assert ("M2PO tracks on-policy (final eval not below on-policy M2PO): "
            "**does not hold** at fixed_staleness 16") in "\n".join(render_claims(group(worse), "staleness"))
    one = [r for r in rows if r["seed"] == 1]
    assert ("degrades with staleness (final eval below on-policy vanilla): "
            "**inconclusive** at fixed_staleness 16") in "\n".join(render_claims(group(one), "staleness"))


def test_async_claims_verdicts():
    from stalerl_study.claims import render_claims

    rows = []
    for seed, eps in ((1, -0.01), (2, 0.0), (3, 0.01)):
        rows += [_fake("vanilla", "stale 4 d1+d1 rollout 32", seed, 0.3 + eps, 0.3, gn=2.0 + eps),
                 _fake("m2po", "stale 4 d1+d1 rollout 32", seed, 0.3 - eps, 0.3, gn=1.0 + eps)]
    text = "\n".join(render_claims(group(rows), "async"))
    assert ("GRPO's (vanilla) mean grad norm is higher than M2PO's: **holds** at stale 4 d1+d1 rollout 32") in text
    assert ("M2PO's final eval accuracy is higher than GRPO's (vanilla): **inconclusive** at "
            "stale 4 d1+d1 rollout 32") in text
    # Settings that disagree are named by verdict, in setting order.
    for seed, eps in ((1, -0.01), (2, 0.0), (3, 0.01)):
        rows += [_fake("vanilla", "stale 16 d2+d1 rollout 64", seed, 0.3, 0.3, gn=1.0 + eps),
                 _fake("m2po", "stale 16 d2+d1 rollout 64", seed, 0.3, 0.3, gn=2.0)]
    assert ("GRPO's (vanilla) mean grad norm is higher than M2PO's: **holds** at stale 4 d1+d1 rollout 32; **does "
            "not hold** at stale 16 d2+d1 rollout 64 (stale 4 d1+d1 rollout 32: vanilla 2.000 ± 0.025 vs m2po 1.000 "
            "± 0.025, paired difference 1.000 ± 0.000, vanilla higher in 3/3 seeds; stale 16 d2+d1 rollout 64: "
            "vanilla 1.000 ± 0.025 vs m2po 2.000 ± 0.000, paired difference -1.000 ± 0.025, vanilla higher in 0/3 "
            "seeds).") \
        in "\n".join(render_claims(group(rows, settings=["stale 4 d1+d1 rollout 32", "stale 16 d2+d1 rollout 64"]),
                                   "async"))


def test_a_shared_warm_start_is_listed_once():
    from stalerl_study.report import render_markdown

    def run(loss, setting, seed, acc):
        return dict(_fake(loss, setting, seed, 0.5, 0.5), warm_start={
            "target_accuracy": 0.25, "cap": 1500, "steps": 100 * seed, "accuracy": acc, "target_reached": 1.0})

    shared = [run(loss, s, seed, 0.3) for loss in ("m2po", "vanilla") for s in ("fixed_staleness 0", "fixed_staleness 4")
              for seed in (1, 2)]
    text = render_markdown(group(shared), study="x")
    assert text.count("target 0.25 reached by 2/2 seeds") == 1
    assert "- every row (one warm start per seed, shared by all methods and settings): target 0.25" in text
    own = shared[:-1] + [run("vanilla", "fixed_staleness 4", 2, 0.4)]  # one cell's warm start differs
    text = render_markdown(group(own), study="x")
    assert text.count("target 0.25 reached by 2/2 seeds") == 4 and "every row" not in text
    assert "- fixed_staleness 4, vanilla: target 0.25 reached by 2/2 seeds" in text


def test_claims_are_paired_by_seed():
    """Seed-to-seed spread that both sides share does not hide a consistent per-seed difference, and only seeds
    present on both sides are paired."""
    from stalerl_study.claims import paired_difference, render_claims

    rows = []
    for seed, base in ((1, 0.2), (2, 0.5), (3, 0.8), (4, 0.35)):  # the warm start's spread: unpaired intervals overlap
        rows += [_fake("vanilla", "stale 16 d2+d1 rollout 64", seed, base, base, gn=1.5 + base),
                 _fake("m2po", "stale 16 d2+d1 rollout 64", seed, base + 0.05 + seed / 1000, base, gn=1.0 + base)]
    cells = group(rows)
    m, v = cells  # methods in name order
    assert v.estimate("eval.final").high > m.estimate("eval.final").low  # overlapping, unpaired
    d = paired_difference(m, v, "eval.final")
    assert d.n == 4 and d.mean == pytest.approx(0.0525) and 0 < d.low < d.high < 0.06
    text = "\n".join(render_claims(cells, "async"))
    assert ("M2PO's final eval accuracy is higher than GRPO's (vanilla): **holds** at "
            "stale 16 d2+d1 rollout 64") in text
    assert "paired difference -0.053 ± " in text
    # Seed 4 only on one side: 3 pairs; one pair: inconclusive ('?').
    assert paired_difference(m, group([r for r in rows if not (r["loss"] == "vanilla" and r["seed"] == 4)])[1],
                             "eval.final").n == 3
    one = [r for r in rows if r["seed"] == 1 or r["loss"] == "m2po"]
    assert ("M2PO's final eval accuracy is higher than GRPO's (vanilla): **inconclusive** at "
            "stale 16 d2+d1 rollout 64") in "\n".join(render_claims(group(one), "async"))


def test_readme_quotes_the_committed_default_study():
    """The README's default-run figures are the committed default study's numbers (not typed independently)."""
    cells = group(load_summaries([REPO / "docs" / "algorithms" / "results" / "default"]))
    assert len(cells) == 1 and len(cells[0].finished) >= 5
    (cell,) = cells
    start, end = cell.estimate("eval.initial"), cell.estimate("eval.final")
    readme = " ".join((REPO / "README.md").read_text().split())  # line breaks do not matter
    assert (f"**{format_estimate(start, 2)}** after the warm start to **{format_estimate(end, 2)}** at step "
            f"{int(cell.finished[0]['steps_done'])}") in readme
    bounds = f"{start.low:.2f}-{start.high:.2f} → {end.low:.2f}-{end.high:.2f}"
    singles = [sorted(r["eval"][k] for r in cell.finished) for k in ("initial", "final")]
    seeds = f"{singles[0][0]:.2f}-{singles[0][-1]:.2f} → {singles[1][0]:.2f}-{singles[1][-1]:.2f}"
    assert f"i.e. {bounds}; single seeds ranged {seeds}" in readme
    assert f"over {len(cell.finished)} seeds" in readme


def test_a_loss_has_one_colour_in_every_figure():
    from stalerl_study.report import method_colors

    async_colors = method_colors(["vanilla", "m2po", "fipo"])
    staleness_colors = method_colors(["m2po", "vanilla", "no_trust_region", "fipo"])
    assert all(async_colors[m] == staleness_colors[m] for m in async_colors)
    assert len(set(staleness_colors.values())) == 4
    labels = ["loss=m2po, behavior_logp=rollout", "loss=vanilla, behavior_logp=rollout"]
    assert method_colors(labels) == {labels[0]: "C0", labels[1]: "C1"}


def test_stalerl_study_compare_finds_a_re_run_identical_or_names_what_differs(tmp_path, capsys):
    """The reuse check: outcome fields of the old summary must all be equal in the renamed re-run (provenance and
    fields the re-run adds do not count); one changed value makes it differ (exit 1)."""
    from stalerl_study.cli import main as study_main

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    for seed in (1, 2, 3):
        s = _fake("vanilla", "fixed_staleness 64", seed, 0.4, 0.5) | {"run": f"vanilla-fs64-seed{seed}", "wall_s": 1}
        (old / f"vanilla-fs64-seed{seed}.json").write_text(json.dumps(s))
        if seed == 3:
            continue  # not re-run
        s = s | {"run": f"vanilla-tau-fs64-seed{seed}", "wall_s": 9, "m2_threshold": 0.04}
        if seed == 2:
            s["eval"] = {**s["eval"], "final": 0.41}
        (new / f"vanilla-tau-fs64-seed{seed}.json").write_text(json.dumps(s))
    (new / "study.json").write_text("{}")
    code = study_main(["compare", str(old), str(new), "--rename", "vanilla-fs64=vanilla-tau-fs64"])
    out = capsys.readouterr().out
    assert code == 1
    assert "vanilla-fs64-seed1 -> vanilla-tau-fs64-seed1: identical in all" in out
    assert "vanilla-fs64-seed2 -> vanilla-tau-fs64-seed2: 1 differ: /eval/final: 0.4 vs 0.41" in out
    assert "vanilla-fs64-seed3 -> vanilla-tau-fs64-seed3: not re-run" in out
    assert out.strip().endswith("1 identical, 1 differ")
    (new / "vanilla-tau-fs64-seed2.json").unlink()
    assert study_main(["compare", str(old), str(new), "--rename", "vanilla-fs64=vanilla-tau-fs64"]) == 0
    assert study_main(["compare", str(old), str(new), "--rename", "nothing"]) == 2


def test_the_masked_vs_clipped_table_appears_only_for_runs_that_recorded_it():
    """Issue 36 item 4: M2PO's masked share beside the share clip would have zeroed on the same tokens, with M2 before
    and after masking; blocks of runs written before actor/m2po/would_clip_fraction existed stay as they were."""
    import copy
    import json

    from stalerl_study.report import group, render_markdown

    committed = json.loads((REPO / "docs" / "algorithms" / "results" / "smollm2_add" /
                            "m2po-fixed_staleness_4-seed1.json").read_text())
    older = copy.deepcopy(committed)  # as a summary written before the metric existed
    del older["fractions"]["m2po/would_clip_fraction"]
    assert "What the trust region removed" not in render_markdown(group([older]), study="smollm2_add")
    text = render_markdown(group([committed]), study="smollm2_add")
    table = text.split("What the trust region removed", 1)[1]
    row = next(line for line in table.splitlines() if line.startswith("| fixed_staleness 4 | m2po |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    diag, frac = committed["diagnostics"], committed["fractions"]
    assert cells[2:] == [f"{diag['actor/m2po/m2_before']['mean']:.3f} (n=1)",
                         f"{diag['actor/m2po/m2_before']['max']:.3f} (n=1)",
                         f"{diag['actor/m2po/m2_after']['mean']:.4f} (n=1)",
                         f"{frac['m2po/masked_fraction']:.4f} (n=1)", f"{frac['m2po/would_clip_fraction']:.4f} (n=1)", "-"]
    assert frac["m2po/would_clip_fraction"] > frac["m2po/masked_fraction"] > 0
