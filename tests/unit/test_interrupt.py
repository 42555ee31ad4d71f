"""stalerl.core.interrupt with real signals sent to this process (the handlers only install in the main thread)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from stalerl.core import interrupt
from stalerl.core.interrupt import RunInterrupted, StopRequests

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers need the main thread")


def _signal_self(sig: int = signal.SIGTERM) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_a_signal_outside_the_steps_stops_at_once():
    with StopRequests(grace_s=5):
        with pytest.raises(RunInterrupted) as stop:
            _signal_self()
    assert stop.value.exit_code == 143 and stop.value.checkpoint_step is None


def test_polled_only_records_each_signal_for_the_waiting_loop():
    with StopRequests(grace_s=5), interrupt.polled():
        _signal_self(signal.SIGINT)
        _signal_self(signal.SIGTERM)
        assert interrupt.stop_requested() == signal.SIGINT  # the first asked for the stop
        assert interrupt.signals_received() == (2, signal.SIGTERM)  # each one is passed on


def test_the_grace_timer_does_not_cut_the_final_save():
    # the signal arrives during the last step (deferred, the grace timer starts), the final save outlasts the grace
    with StopRequests(grace_s=0.2):
        with interrupt.deferred():
            _signal_self()
            with interrupt.shielded():
                time.sleep(0.6)  # "the final checkpoint and finished.json": the timer fires in here
                saved = True
        assert saved and interrupt.stop_requested() == signal.SIGTERM


def test_a_signal_during_the_final_save_lets_it_end_but_a_second_one_stops_at_once(capsys):
    with StopRequests(grace_s=5), interrupt.deferred(), interrupt.shielded():
        _signal_self()
        _signal_self()  # within a second: the same request (e.g. Slurm's and the job shell's copy)
        assert "finishing the run's final save" in capsys.readouterr().out
        time.sleep(1.1)
        with pytest.raises(RunInterrupted) as stop:
            _signal_self()
    assert "second signal" in str(stop.value)


def test_a_step_that_outlasts_the_grace_is_stopped_at_once():
    with StopRequests(grace_s=0.2), interrupt.deferred():
        _signal_self()  # asks for a stop at the end of the step ...
        with pytest.raises(RunInterrupted) as stop:
            time.sleep(2)  # ... which has not come within the grace: the timer stops it here
    assert "did not end within 0.2s" in str(stop.value) and stop.value.checkpoint_step is None
    assert stop.value.abandoned  # the loop may save the last completed step on the way out


def test_a_cut_step_reports_the_last_completed_step_it_saved_and_the_step_to_repeat():
    cut = RunInterrupted(signal.SIGINT, note="the step did not end within 20s", abandoned=True)
    saved = cut.saved(10, 10)
    assert str(saved) == ("interrupted by SIGINT at step 10; the step did not end within 20s: final checkpoint of "
                          "step 10 written; the same command resumes from it and repeats step 11")
    assert saved.exit_code == 130 and saved.record() == {"signal": "SIGINT", "signum": 2, "step": 10,
                                                         "checkpoint_step": 10}
    assert str(cut.saved(10, None)).endswith("the step did not end within 20s: stopped without a final checkpoint "
                                             "(the last one written, if any, is intact)")
    # a stop at a step's end is unchanged: no step to repeat
    assert str(RunInterrupted(signal.SIGTERM, step=4, checkpoint_step=4)) == (
        "interrupted by SIGTERM at step 4; final checkpoint of step 4 written; the same command resumes from it")


def test_a_second_signal_during_a_step_stops_at_once():
    with StopRequests(grace_s=30), interrupt.deferred():
        _signal_self()
        time.sleep(1.1)
        with pytest.raises(RunInterrupted) as stop:
            _signal_self()
    assert "second signal" in str(stop.value) and not stop.value.abandoned  # at once: nothing more is written


def test_a_run_inside_a_ray_task_gets_its_log_its_pid_and_sigint(tmp_path):
    """in_ray_task (both Ray entry points use it): as in Ray's worker, SIGINT starts blocked; inside, it is unblocked
    (a forwarded Ctrl-C reaches the run), the output goes to the log and the pid file names the process; afterwards
    the worker's mask is back. Run in a child process: the redirection replaces stdout/stderr for good."""
    import subprocess
    import sys

    log, pid = tmp_path / "logs" / "run.log", tmp_path / "run.pid"
    child = (
        "import os, signal, sys\n"
        "from stalerl.launch.launcher import in_ray_task\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n"
        f"with in_ray_task({str(log)!r}, {str(pid)!r}):\n"
        "    print('inside', signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
        "    print('to stderr', file=sys.stderr)\n"
        "print('after', signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
        "os.write(1, str(os.getpid()).encode())\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == ""  # everything went to the log, even after the block
    text = log.read_text()
    assert "inside False" in text and "to stderr" in text and "after True" in text
    assert text.endswith(pid.read_text())
