"""The asynchronous dX+dY runtime with real worker processes: bound, eta=0 equivalence, DP equivalence, failures,
resume."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CPU_CONFIG, REPO, SLOW_TRAINER_ENV, assert_full_window_staleness, small_overrides
from stalerl.results.metrics_log import read_metrics

SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
pytestmark = pytest.mark.slow


def _cmd(tmp_path, trial, **extra):
    over = small_overrides(tmp_path, **{"rollout.fixed_staleness": 0, "trial_name": trial, **extra})
    return [sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *over]


def _run(cmd, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(tmp_path, trial):
    return read_metrics(tmp_path / "runs" / "gsm8k-m2po-cpu" / trial)


KEYS = ("reward", "reward/generated", "reward/consumed", "actor/loss", "actor/grad_norm", "actor/m2po/masked_fraction",
        "response_length")


def test_bound_holds_and_is_used(tmp_path):
    # A trainer slower than its rollouts (the test hook makes it wait until the staleness window is full) must train
    # on data exactly as old as the bound allows: step t consumes samples of version 0 while t <= 3, then t - 3.
    res = _run(_cmd(tmp_path, "eta2", **{"rollout.max_head_offpolicyness": 2, "total_train_steps": 8}),
               env_extra=SLOW_TRAINER_ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_full_window_staleness(_rows(tmp_path, "eta2")[1:], eta=2, steps=8)


def test_bound_holds_when_rollouts_and_training_race(tmp_path):
    # No hook: whichever side is faster on this machine, every consumed sample stays within the bound.
    res = _run(_cmd(tmp_path, "race", **{"rollout.max_head_offpolicyness": 2, "total_train_steps": 8}))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path, "race")[1:]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(0 <= r["staleness/max"] <= 2 for r in rows)
    assert all(sum(r["staleness/hist"]) == 8 * 4 for r in rows)


@pytest.mark.parametrize("behavior_logp, correction", [("rollout", "none"), ("recompute", "none"),
                                                        ("recompute", "tis_token")])
def test_eta_zero_equals_the_synchronous_loop(tmp_path, behavior_logp, correction):
    # tis_token: rollout correction from the rollout workers' recompute (async) and the loop's own (sync) alike
    common = {"actor.behavior_logp": behavior_logp, "rollout_correction.mode": correction,
              "rollout_correction.threshold": 1.0}
    keys = KEYS + (() if correction == "none" else ("rollout_correction/weight_mean", "rollout_correction/kl_k3",
                                                    "rollout_correction/rejected_fraction"))
    sync = _run(_cmd(tmp_path, "sync", **{"rollout.mode": "sync", **common}))
    asyn = _run(_cmd(tmp_path, "async", **{"rollout.mode": "async", "rollout.max_head_offpolicyness": 0, **common}))
    assert sync.returncode == 0, sync.stderr[-3000:]
    assert asyn.returncode == 0, asyn.stderr[-3000:]
    a, b = _rows(tmp_path, "sync"), _rows(tmp_path, "async")
    assert len(a) == len(b) == 7
    for ra, rb in zip(a[1:], b[1:]):
        assert rb["staleness/max"] == 0
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), (ra["step"], k)
    assert [r.get("eval/accuracy") for r in a] == [r.get("eval/accuracy") for r in b]
    if correction != "none":  # min(rho, 1): the engine's and the trainer's log-probs both reached the actor
        assert all(0.9 < r["rollout_correction/weight_mean"] <= 1.0 for r in a[1:])


@pytest.mark.parametrize("n_mini", [1, 2])
def test_two_train_ranks_match_one(tmp_path, n_mini):
    extra = {"rollout.mode": "async", "rollout.max_head_offpolicyness": 0, "total_train_steps": 3,
             "actor.ppo_n_minibatches": n_mini}
    one = _run(_cmd(tmp_path, "d1", **extra))
    two = _run(_cmd(tmp_path, "d2", **{**extra, "actor.backend": "torch:d2"}))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    for ra, rb in zip(_rows(tmp_path, "d1")[1:], _rows(tmp_path, "d2")[1:]):
        for k in KEYS:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (ra["step"], k)


def _worker_pid(log: Path, deadline: float) -> int:
    while time.time() < deadline:
        if log.exists():
            m = re.search(r"ready \(pid (\d+)\)", log.read_text())
            if m:
                return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError(f"no pid in {log}")


def test_killed_rollout_worker_fails_the_run_with_its_code(tmp_path):
    cmd = _cmd(tmp_path, "killed", **{"rollout.max_head_offpolicyness": 1, "total_train_steps": 500})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "runs" / "gsm8k-m2po-cpu" / "killed"
    pid = _worker_pid(run / "logs" / "rollout-0.log", time.time() + 120)
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < 3:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    out, err = proc.communicate(timeout=60)
    assert time.time() - killed_at < 30  # promptly, no hang
    assert proc.returncode == 128 + signal.SIGKILL
    assert "rollout/0" in err and "exit code -9" in err
    assert "rollout worker 0 ready" in err  # the tail of the worker's log is quoted


def test_worker_exception_fails_the_run_with_traceback(tmp_path):
    res = _run(_cmd(tmp_path, "raises", **{"rollout.max_head_offpolicyness": 1, "total_train_steps": 50}),
               env_extra={"STALERL_INJECT_FAULT": "rollout/0:generate:3"})
    assert res.returncode == 1
    assert "injected fault in rollout/0.generate call 3" in res.stderr
    assert "Traceback" in res.stderr


def test_resume_after_sigkill_keeps_the_bound(tmp_path, sigkill_after_checkpoint):
    extra = {"rollout.max_head_offpolicyness": 2, "total_train_steps": 10, "recover.mode": "auto",
             "recover.freq_steps": 2}
    cmd = _cmd(tmp_path, "resume", **extra)
    run = tmp_path / "runs" / "gsm8k-m2po-cpu" / "resume"
    assert sigkill_after_checkpoint(cmd, run, 4) == -signal.SIGKILL
    res = _run(cmd)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(0, 11))
    assert all(r["staleness/max"] <= 2 for r in rows[1:])
    assert "resumed from checkpoint at step" in res.stdout + res.stderr


def test_train_rank_exception_is_reported_as_the_workers_failure(tmp_path):
    res = _run(_cmd(tmp_path, "trainfault", **{"rollout.max_head_offpolicyness": 1, "actor.backend": "torch:d2",
                                               "total_train_steps": 20}),
               env_extra={"STALERL_INJECT_FAULT": "train/1:update:2"}, timeout=180)
    assert res.returncode == 1
    assert "stalerl: worker train/1 failed" in res.stderr
    assert "injected fault in train/1.update call 2" in res.stderr


def test_disk_weight_sync_with_two_rollout_workers(tmp_path):
    res = _run(_cmd(tmp_path, "disk", **{"rollout.max_head_offpolicyness": 2, "rollout.weight_sync": "disk",
                                         "rollout.backend": "hf:d2", "total_train_steps": 6}))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path, "disk")
    assert [r["step"] for r in rows] == list(range(0, 7))
    assert all(r["staleness/max"] <= 2 for r in rows[1:])
    left = sorted((tmp_path / "runs" / "gsm8k-m2po-cpu" / "disk" / "weights").glob("v*.pt"))
    assert left == []  # transient: deleted once loaded or superseded, the rest at shutdown


def test_a_dying_dispatcher_fails_the_run_instead_of_hanging():
    from stalerl.training.async_source import AdmissionSource

    t = AdmissionSource.__new__(AdmissionSource)  # only the failure plumbing, no workers
    import threading

    t.cond, t.failure, t.stop_event = threading.Condition(), None, threading.Event()
    t.stop_event.set()  # keep the watchdog from exiting the test process

    def boom():
        raise KeyError("task 17 finished twice")

    t._dispatch = boom
    t._dispatch_loop()
    assert t.failure is not None and t.failure.role == "dispatcher"
    assert "task 17 finished twice" in t.failure.message


def test_training_goes_on_while_an_evaluation_runs_on_a_rollout_worker(tmp_path):
    # Every evaluation takes >= 6 s on its worker (test hook); with two rollout workers the other one keeps
    # generating, so the trainer logs steps past an evaluation's step before that evaluation has finished.
    res = _run(_cmd(tmp_path, "evalbg", **{"rollout.max_head_offpolicyness": 2, "rollout.backend": "hf:d2",
                                           "total_train_steps": 6}),
               env_extra={"STALERL_TEST_SLOW_EVAL_S": "6"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    went_on = [(int(v), int(s)) for v, s in re.findall(r"eval \(step (\d+), on rollout/\d, [\d.]+s while training "
                                                        r"went on to step (\d+)\)", out)]
    assert [v for v, _ in went_on] == [0, 3, 6], out[-3000:]
    assert any(s > v for v, s in went_on), went_on  # training steps were taken while an evaluation ran
    rows = _rows(tmp_path, "evalbg")
    assert [r["step"] for r in rows] == list(range(0, 7))  # one row per step, in order, as the sync loop writes
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3, 6]
    assert all(r["eval/seconds"] >= 6 for r in rows if "eval/accuracy" in r)


def test_workers_that_oversubscribe_the_cpus_wait_passively(tmp_path):
    """d1+d1 at one thread each on one CPU (this run's affinity): the run says its workers' OpenMP threads wait
    passively, and a live worker's environment holds OMP_WAIT_POLICY=PASSIVE (set before it was spawned)."""
    cpu = min(os.sched_getaffinity(0))
    cmd = _cmd(tmp_path, "passive", **{"rollout.max_head_offpolicyness": 1, "total_train_steps": 500})
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}), start_new_session=True)
    run = tmp_path / "runs" / "gsm8k-m2po-cpu" / "passive"
    try:
        pid = _worker_pid(run / "logs" / "rollout-0.log", time.time() + 600)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_WAIT_POLICY=PASSIVE" in environ
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    lines = [ln for ln in (out + err).splitlines() if "OMP_WAIT_POLICY=PASSIVE for the worker processes" in ln]
    assert len(lines) == 1 and "(2 threads on 1 CPUs)" in lines[0], (out + err)[-3000:]
