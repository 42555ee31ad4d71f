"""First-run pieces without training: config lookup, trial-directory rules, preflight messages, the summary block,
one-line errors, and the torch-free validation tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO
from stalerl.config import load_config
from stalerl.launch.config_lookup import resolve_config_path
from stalerl.core.errors import UserError
from stalerl.launch.preflight import check_before_launch, check_ray_fit, path_problems
from stalerl.results.run_summary_console import format_run_summary
from stalerl.training.trial_dir import check_trial_dir, config_dict, differing_keys, write_finished

EXAMPLES = REPO / "examples" / "math"


# ------------------------------------------------------------------------------------------------ config lookup
def test_bare_config_name_is_found_among_the_example_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = Path(resolve_config_path("gsm8k_m2po.yaml", script=""))
    assert found.resolve() == (EXAMPLES / "gsm8k_m2po.yaml").resolve()


def test_repo_relative_config_works_from_inside_the_examples_dir(monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    found = Path(resolve_config_path("examples/math/gsm8k_m2po_cpu.yaml", script="gsm8k_rl.py"))
    assert found.resolve() == (EXAMPLES / "gsm8k_m2po_cpu.yaml").resolve()


def test_config_next_to_the_script_wins_over_the_examples(tmp_path, monkeypatch):
    script_dir = tmp_path / "proj"
    script_dir.mkdir()
    (script_dir / "run.py").write_text("")
    (script_dir / "gsm8k_m2po.yaml").write_text("seed: 3\n")
    monkeypatch.chdir(tmp_path)
    assert Path(resolve_config_path("gsm8k_m2po.yaml", script=str(script_dir / "run.py"))).resolve() == \
        (script_dir / "gsm8k_m2po.yaml").resolve()


def test_a_config_that_exists_here_is_used_as_given(tmp_path, monkeypatch):
    (tmp_path / "gsm8k_m2po.yaml").write_text("seed: 3\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("gsm8k_m2po.yaml", script="") == "gsm8k_m2po.yaml"


def test_missing_config_lists_where_it_looked_and_the_shipped_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        resolve_config_path("gsm8k_m2pp.yaml", script="")
    msg = str(e.value)
    assert "gsm8k_m2pp.yaml" in msg and "gsm8k_m2po_cpu.yaml" in msg and "\n" not in msg


@pytest.mark.parametrize("name", ["gsm8k_m2po.yml", "gsm8k_m2pp.yaml"])
def test_looked_in_list_names_each_place_once_from_the_scripts_folder(name, monkeypatch):
    # issue 28: run from examples/math, "x.yml" and examples/math/x.yml are one place, listed twice before
    monkeypatch.chdir(EXAMPLES)
    with pytest.raises(UserError) as e:
        resolve_config_path(name, script="gsm8k_rl.py")
    looked = str(e.value).split("(looked in: ", 1)[1].split(")", 1)[0].split(", ")
    assert name in looked and len(looked) == len(set(looked)), looked


# ------------------------------------------------------------------------------------------------ trial directory
def _cfg(tmp_path, *extra):
    return load_config(["--config", str(EXAMPLES / "gsm8k_m2po_cpu.yaml"), f"cluster.fileroot={tmp_path}",
                        "recover.mode=auto", *extra])


def _fake_checkpoint(run_dir: Path, cfg, step: int, steps_per_epoch: int = 625) -> None:
    d = run_dir / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step, "config": config_dict(cfg), "total_steps": step,
                                             "steps_per_epoch": steps_per_epoch}))
    (run_dir / "checkpoints" / "latest").write_text(f"step_{step}\n")


def test_differing_keys_names_what_matters_and_ignores_hosting_and_logging(tmp_path):
    a = config_dict(_cfg(tmp_path))
    b = config_dict(_cfg(tmp_path, "rollout.fixed_staleness=0", "scheduler.type=ray", "torch_threads=1",
                         "stats_logger.log_every=1", "evaluator.freq_steps=5", "total_train_steps=400"))
    assert [k for k, _, _ in differing_keys(a, b)] == ["rollout.fixed_staleness"]


def test_a_run_with_a_different_config_is_refused_naming_keys_and_both_ways_out(tmp_path):
    old = _cfg(tmp_path)
    run = tmp_path / old.experiment_name / old.trial_name
    _fake_checkpoint(run, old, 50)
    new = _cfg(tmp_path, "rollout.fixed_staleness=0", "actor.loss=vanilla")
    with pytest.raises(UserError) as e:
        check_trial_dir(new, run, log=lambda *_: None)
    msg = str(e.value)
    assert "rollout.fixed_staleness (checkpoint 4, this run 0)" in msg and "actor.loss" in msg
    assert "trial_name=" in msg and "recover.mode=disabled" in msg
    check_trial_dir(_cfg(tmp_path), run, log=lambda *_: None)  # the same config resumes


def test_a_finished_trial_is_refused_unless_extended(tmp_path):
    cfg = _cfg(tmp_path)
    run = tmp_path / cfg.experiment_name / cfg.trial_name
    _fake_checkpoint(run, cfg, 300)
    write_finished(run, step=300, total_steps=300, steps_per_epoch=625)
    for extra in ([], ["total_train_steps=20"]):
        with pytest.raises(UserError, match=r"is finished \(step 300 of 300\).*total_train_steps above 300"):
            check_trial_dir(_cfg(tmp_path, *extra), run, log=lambda *_: None)
    logged = []
    check_trial_dir(_cfg(tmp_path, "total_train_steps=400"), run, log=logged.append)
    assert "extending finished trial" in logged[0] and "to 400" in logged[0]
    assert not (run / "finished.json").exists()


def test_an_extension_the_epochs_cap_makes_empty_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    run = tmp_path / cfg.experiment_name / cfg.trial_name
    _fake_checkpoint(run, cfg, 10, steps_per_epoch=10)
    write_finished(run, step=10, total_steps=10, steps_per_epoch=10)
    with pytest.raises(UserError, match="is finished"):
        check_trial_dir(_cfg(tmp_path, "total_train_steps=400"), run, log=lambda *_: None)  # 1 epoch = 10 steps
    check_trial_dir(_cfg(tmp_path, "total_train_steps=400", "total_train_epochs=2"), run, log=lambda *_: None)


def test_a_checkpoint_past_this_runs_last_step_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    run = tmp_path / cfg.experiment_name / cfg.trial_name
    _fake_checkpoint(run, cfg, 250)
    with pytest.raises(UserError, match="step 250, past this run's last step 20"):
        check_trial_dir(_cfg(tmp_path, "total_train_steps=20"), run, log=lambda *_: None)


def test_recover_disabled_starts_over_and_sets_old_state_aside(tmp_path):
    cfg = _cfg(tmp_path)
    run = tmp_path / cfg.experiment_name / cfg.trial_name
    _fake_checkpoint(run, cfg, 300)
    write_finished(run, step=300, total_steps=300, steps_per_epoch=625)
    check_trial_dir(_cfg(tmp_path, "recover.mode=disabled", "rollout.fixed_staleness=0"), run, log=lambda *_: None)
    assert not (run / "checkpoints").exists() and not (run / "finished.json").exists()
    assert len(list(run.glob("checkpoints.*"))) == 1 and len(list(run.glob("finished.*.json"))) == 1
    check_trial_dir(cfg, run, log=lambda *_: None)  # nothing left to continue: a fresh start


# ------------------------------------------------------------------------------------------------ preflight
def test_missing_data_and_model_paths_are_named_by_their_keys(tmp_path):
    cfg = _cfg(tmp_path, "train_dataset.path=/nonexistent/gsm8k", f"actor.path={tmp_path}/nomodel")
    problems = path_problems(cfg)
    assert any(p.startswith("train_dataset.path='/nonexistent/gsm8k'") for p in problems)
    assert any(p.startswith("actor.path=") for p in problems)
    with pytest.raises(UserError) as e:
        check_before_launch(cfg)
    assert "data.path" not in str(e.value).replace("_dataset.path", "")


def test_gpu_config_on_a_cpu_machine_says_what_to_do(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    cfg = load_config(["--config", str(EXAMPLES / "gsm8k_m2po.yaml")])
    for kind in ("local", "ray"):
        cfg.scheduler.type = kind
        with pytest.raises(UserError) as e:
            check_before_launch(cfg)
        msg = str(e.value)
        assert "actor.device='cuda'" in msg and "gsm8k_m2po_cpu.yaml" in msg and "actor.path=<model dir>" in msg


def test_ray_fit_check_says_what_was_asked_and_what_exists():
    check_ray_fit({"CPU": 2, "GPU": 0}, {"CPU": 2.0}, "x", "fix")
    with pytest.raises(UserError) as e:
        check_ray_fit({"CPU": 8, "GPU": 1}, {"CPU": 2.0}, "the loop", "lower torch_threads")
    msg = str(e.value)
    assert "asked CPU 8, GPU 1" in msg and "the cluster has CPU 2, GPU 0" in msg and "lower torch_threads" in msg


def test_data_hint_names_real_keys():
    from stalerl.data.gsm8k import _HINT

    assert "train_dataset.path=" in _HINT and " data.path" not in _HINT and "(e.g. data.path" not in _HINT


# ------------------------------------------------------------------------------------------------ output
def test_summary_block_has_the_figures_and_the_output_paths(tmp_path):
    import json

    from stalerl.results.run_summary_console import summary_row

    (tmp_path / "final_model").mkdir()
    (tmp_path / "tensorboard").mkdir()
    # The row comes from a metrics.jsonl as the trainer writes it (names included), not from a hand-made dict.
    records = [{"step": s, "reward/generated": 0.3, "reward/consumed": 0.2, "reward": 0.2, "staleness/avg": 3.9,
                "staleness/max": 4.0, "actor/m2po/masked_fraction": 0.012} for s in range(1, 301)]
    records[-1]["eval/accuracy"] = 0.33
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = summary_row(tmp_path)
    text = format_run_summary(row, tmp_path, wall_s=81.4, first_eval=0.07)
    assert "steps 300" in text and "wall time 81s" in text
    assert "final reward generated 0.3, consumed 0.2" in text
    assert "eval accuracy 0.07 -> 0.33" in text and "staleness avg 3.9, max 4" in text
    assert "masked fraction 0.012" in text and "clip fraction" not in text
    for part in ("metrics.jsonl", "tensorboard --logdir", "final_model", "stalerl-plot"):
        assert part in text
    assert "checkpoints" not in text  # none written (recover.mode=disabled)
    (tmp_path / "checkpoints").mkdir()
    assert f"checkpoints  {tmp_path / 'checkpoints'}" in format_run_summary(row, tmp_path)
    # An async run whose rollout workers were done before the last 10% of steps: says why there is no number.
    for r in records[-30:]:
        del r["reward/generated"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = format_run_summary(summary_row(tmp_path), tmp_path)
    assert "final reward generated - (no rollout finished in those steps), consumed 0.2" in text


def test_multi_problem_config_errors_print_on_one_line():
    from stalerl.launch.cli import one_line

    err = ValueError("invalid config (2 problems):\n  - a.b: bad\n  - c: worse")
    assert one_line(err) == "invalid config (2 problems): a.b: bad; c: worse"


def test_builtin_loss_table_matches_what_the_recipes_register():
    from recipe.registry import BUILTIN_POLICY_LOSSES, LOSS_AGG_MODES, registered_policy_losses
    import recipe.common

    assert set(BUILTIN_POLICY_LOSSES) <= set(registered_policy_losses())
    assert recipe.common.LOSS_AGG_MODES is LOSS_AGG_MODES


def test_resume_without_a_checkpoint_is_refused_before_launch(tmp_path):
    cfg = _cfg(tmp_path, "recover.mode=resume")
    with pytest.raises(UserError, match="recover.mode=resume but trial .* has no checkpoint"):
        check_trial_dir(cfg, tmp_path / cfg.experiment_name / cfg.trial_name, log=lambda *_: None)


def test_a_model_directory_without_config_json_is_named(tmp_path):
    (tmp_path / "model").mkdir()
    cfg = _cfg(tmp_path, f"actor.path={tmp_path / 'model'}")
    assert any("has no config.json" in p for p in path_problems(cfg))


def test_local_sweep_points_count_start_up_from_their_own_launch(monkeypatch):
    """A sweep's points run one after another; each gets its own launch time (the parent's would count the earlier
    points as this one's start-up overhead)."""
    import time

    from stalerl.launch import cli, launcher
    from stalerl.core.launch_env import LAUNCH_TIME_ENV

    monkeypatch.setenv(LAUNCH_TIME_ENV, repr(time.time() - 1000.0))  # the sweep started long ago
    seen = []

    def fake_run(cmd, env):
        seen.append((float((env or {}).get(LAUNCH_TIME_ENV, "nan")), time.time()))
        return 0, None  # exit code 0, no signal

    monkeypatch.setattr(launcher, "run_child_passing_signals", fake_run)
    assert cli._run_local(None, [("a", ["seed=1"]), ("b", ["seed=2"])]) == (["ok", "ok"], None)
    assert len(seen) == 2 and all(0 <= called - launched < 5 for launched, called in seen)


# ------------------------------------------------------------------------------------------------ issue 28 small things
def test_usage_line_names_debug(capsys):
    from stalerl.launch.cli import main

    assert main(["--help"]) == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith("usage: ") and "[--debug]" in usage and "[--dry-run]" in usage


def test_summary_wall_s_total_covers_every_session_of_a_continued_trial(tmp_path):
    from stalerl.config import run_dir
    from stalerl.results.run_summary import read_summary, total_wall_s, write_run_summary

    cfg = _cfg(tmp_path)  # recover.mode=auto: a later session continues the trial (resume or extension)
    write_run_summary(cfg, status="finished", wall_s=100.0)
    first = read_summary(run_dir(cfg))
    assert first["wall_s"] == 100.0 and first["wall_s_total"] == 100.0
    write_run_summary(cfg, status="finished", wall_s=30.0)  # the extension's session
    second = read_summary(run_dir(cfg))
    assert second["wall_s"] == 30.0 and second["wall_s_total"] == 130.0
    write_run_summary(cfg, status="finished", wall_s=5.0)
    assert read_summary(run_dir(cfg))["wall_s_total"] == 135.0
    # recover.mode=disabled starts the trial over: only this session counts
    fresh = load_config(["--config", str(EXAMPLES / "gsm8k_m2po_cpu.yaml"), f"cluster.fileroot={tmp_path}",
                         "recover.mode=disabled"])
    write_run_summary(fresh, status="finished", wall_s=7.0)
    assert read_summary(run_dir(fresh))["wall_s_total"] == 7.0
    # a summary from before the field: its wall_s is the earlier total
    assert total_wall_s({"wall_s": 50.0}, 10.0, "auto") == 60.0
    assert total_wall_s(None, 10.0, "resume") == 10.0
