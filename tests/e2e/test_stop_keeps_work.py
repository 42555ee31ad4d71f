"""A stop keeps the work done (issue 45): a SIGTERM whose step cannot end within the grace writes the checkpoint of
the last completed step (stalerl.training.last_step), so the resume repeats only the cut step and logs exactly the
metrics of an uninterrupted run. The stop is landed mid-generation and mid-update (between the update's optimizer
steps: the live weights and optimizer have moved, so only the kept copy resumes the same run) by the test hook
STALERL_TEST_PAUSE, through the real command, with periodic checkpoints out of reach (recover.freq_steps=50): before
this, such a stop lost every step since the start.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, small_overrides
from stalerl.results.metrics_log import read_metrics
from test_faults import EXP, _cmd, _comparable, _env, assert_one_line, run_cli

STEPS = 6
CUT = 4  # the step the stop cuts: step 3's state is saved, step 4 is done again


def _common(tmp_path: Path) -> list[str]:
    # two mini-batches: the update takes two optimizer steps, and the pause lands between them; a warm start long
    # enough that some groups get rewards (nonzero advantages: the updates move the weights)
    return small_overrides(tmp_path, **{"total_train_steps": STEPS, "recover.mode": "auto", "recover.freq_steps": 50,
                                        "rollout.fixed_staleness": 1, "evaluator.freq_steps": 3,
                                        "actor.ppo_n_minibatches": 2, "warm_start.steps": 100,
                                        **{f"{split}.synthetic.{k}": v for split in ("train_dataset", "valid_dataset")
                                           for k, v in (("max_operand", 29), ("test_size", 64))}})


def _stop_mid_step(args: list[str], tmp_path: Path, phase: str) -> subprocess.CompletedProcess:
    """Run with a pause in ``phase`` of step CUT, SIGTERM it there; the 1 s grace runs out inside the pause."""
    mark = tmp_path / f"paused-{phase}"
    env = {**_env(), "STALERL_STOP_GRACE_S": "1", "STALERL_TEST_PAUSE": f"{phase}@{CUT}:300",
           "STALERL_TEST_PAUSE_MARK": str(mark)}
    proc = subprocess.Popen(_cmd(args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 400
        while not mark.exists():
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run, checkpointing by time (recover.freq_minutes, a few ms: after every step)."""
    tmp = tmp_path_factory.mktemp("reference")
    res = run_cli([*_common(tmp), "trial_name=uninterrupted", "recover.freq_minutes=0.0001", "recover.keep_last=10"])
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp / "runs" / EXP / "uninterrupted"
    from stalerl.training.checkpoint import list_checkpoints

    # recover.freq_steps=50 never fires: every checkpoint here is a time-based one
    assert [s for s, _ in list_checkpoints(run)] == list(range(1, STEPS + 1))
    rows = read_metrics(run)
    # steps before the cut train (AdamW's moments are nonzero: every later optimizer step moves the weights) and so
    # do steps after it: a stop that saved the moved weights or optimizer would change what follows
    grads = [r["actor/grad_norm"] for r in rows[1:]]
    assert any(g > 0 for g in grads[:CUT - 1]) and any(g > 0 for g in grads[CUT - 1:]), grads
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["generation", "update"])
def test_a_stop_whose_step_outlasts_the_grace_saves_the_last_completed_step(tmp_path, reference, phase):
    common = [*_common(tmp_path), "trial_name=cut"]
    run = tmp_path / "runs" / EXP / "cut"
    res = _stop_mid_step(common, tmp_path, phase)
    line = assert_one_line(res, 143, f"interrupted by SIGTERM at step {CUT - 1}", "did not end within 1s",
                           f"final checkpoint of step {CUT - 1} written", f"repeats step {CUT}")
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted"]["checkpoint_step"] == CUT - 1, (s, line)
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{CUT - 1}"
    assert [r["step"] for r in read_metrics(run)] == list(range(CUT))  # the cut step's row never written

    resumed = run_cli(common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint at step {CUT - 1}" in resumed.stdout
    assert _comparable(read_metrics(run)) == _comparable(reference)


@pytest.mark.slow
def test_without_the_actor_copy_a_stop_cut_in_the_update_says_why_nothing_was_saved(tmp_path):
    """recover.last_step_copy=false (the memory opt-out): the stop cut mid-update has no copy of the step before it,
    so it keeps only the periodic checkpoints (none here) and its one line says so; the stop cut mid-generation is the
    parametrized test above with the copy on (the live actor is still that step's either way)."""
    args = [*_common(tmp_path), "trial_name=nocopy", "recover.last_step_copy=false"]
    res = _stop_mid_step(args, tmp_path, "update")
    assert_one_line(res, 143, "did not end within 1s (recover.last_step_copy=false: the update had started)",
                    "without a final checkpoint")
    assert not (tmp_path / "runs" / EXP / "nocopy" / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_without_checkpoints_a_cut_step_says_nothing_was_saved(tmp_path):
    args = [*small_overrides(tmp_path, **{"total_train_steps": STEPS, "recover.mode": "disabled"}), "trial_name=off"]
    res = _stop_mid_step(args, tmp_path, "generation")
    assert_one_line(res, 143, "did not end within 1s (recover.mode=disabled)", "without a final checkpoint")
    assert not (tmp_path / "runs" / EXP / "off" / "checkpoints").exists()


@pytest.mark.slow
def test_an_async_run_cut_mid_update_saves_its_last_step_with_the_staleness_queue_and_resumes_within_the_bound(
        tmp_path, monkeypatch):
    """The asynchronous source (rollout worker processes, the staleness manager's queue): the cut step's kept state
    is taken at the step boundary without waiting on the workers; the resume re-submits what was running then and
    every step still trains on data exactly as stale as the bound allows (the slow-trainer test hook fixes it)."""
    from conftest import SLOW_TRAINER_ENV, assert_full_window_staleness

    eta = 2
    args = [*small_overrides(tmp_path, **{"total_train_steps": STEPS, "recover.mode": "auto",
                                          "recover.freq_steps": 50, "rollout.fixed_staleness": 0,
                                          "rollout.max_head_offpolicyness": eta, "evaluator.freq_steps": 3}),
            "trial_name=async-cut"]
    run = tmp_path / "runs" / EXP / "async-cut"
    for k, v in SLOW_TRAINER_ENV.items():
        monkeypatch.setenv(k, v)  # both runs' environments are taken from this process's
    res = _stop_mid_step(args, tmp_path, "update")
    assert_one_line(res, 143, f"interrupted by SIGTERM at step {CUT - 1}", "did not end within 1s",
                    f"final checkpoint of step {CUT - 1} written", f"repeats step {CUT}")
    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint at step {CUT - 1}" in resumed.stdout
    rows = read_metrics(run)
    assert_full_window_staleness(rows[1:], eta, STEPS)
    evaluated = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evaluated == [0, 3, 6], evaluated  # step 3's evaluation (running on a worker at the cut) re-run
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
