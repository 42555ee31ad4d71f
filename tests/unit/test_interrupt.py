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


def test_a_second_signal_during_a_step_stops_at_once():
    with StopRequests(grace_s=30), interrupt.deferred():
        _signal_self()
        time.sleep(1.1)
        with pytest.raises(RunInterrupted) as stop:
            _signal_self()
    assert "second signal" in str(stop.value)
