"""SIGTERM and SIGINT stop a run cleanly (torch-free; installed by the launcher in the run's main thread).

What Slurm's scancel, Kubernetes, Ray and a shell's ``kill`` send first is SIGTERM; Ctrl-C is SIGINT. Either one:

- during the training steps, asks the loop to stop at the end of the step in progress: the loop then writes a final
  checkpoint of that step (when checkpoints are on) and raises :class:`RunInterrupted`. If the step and that
  checkpoint have not finished within :data:`GRACE_S` seconds (``STALERL_STOP_GRACE_S``), the step in progress is
  abandoned (:attr:`RunInterrupted.abandoned`): the loop writes the checkpoint of the last *completed* step instead,
  from the copy it keeps of it (:mod:`stalerl.training.last_step`), so a resume repeats at most the abandoned
  step. A second signal at least a second after the first stops at once, without any final checkpoint (the user
  insists; the previous checkpoint is intact: checkpoints are atomic);
- inside :class:`polled` (a driver waiting on a Ray task, a local sweep waiting on its run's process) only records
  the signal: raising it there would cut a library call in half (inside ``ray.wait`` it becomes a ``SystemError``),
  so the waiting loop polls :func:`stop_requested` / :func:`signals_received` and passes the signal on;
- during the end of a run (:class:`shielded`: the last checkpoint, the final model, ``finished.json``) only records
  it too, so the run ends finished with its completion marker; a second signal (a second or more later) still
  stops at once (the checkpoints are atomic; the trial then resumes from the last one and writes the marker);
- anywhere else (start-up, the warm start, worker start) stops at once.

The launcher writes ``summary.json`` with ``status: interrupted`` and the signal, the command line prints one line
and exits with ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), as a shell reports a process killed by it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Optional

GRACE_ENV = "STALERL_STOP_GRACE_S"
GRACE_S = 20.0  # below the 30 s a Slurm KillWait or a Kubernetes termination grace gives by default
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_REPEAT_S = 1.0  # a signal repeated within this is the same request (scancel signals the job and its shell forwards)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunInterrupted(BaseException):
    """The run was stopped by a signal. A BaseException (like KeyboardInterrupt), so no ``except Exception`` on the way
    up swallows it. ``checkpoint_step``: the step of the final checkpoint written on the way out, if any.
    ``abandoned``: the step in progress was cut (the grace ran out, or a worker it needed stopped), so the training
    loop may write the checkpoint of the last completed step on the way out (:meth:`saved`)."""

    def __init__(self, signum: int, *, step: Optional[int] = None, checkpoint_step: Optional[int] = None,
                 note: str = "", abandoned: bool = False):
        self.signum = int(signum)
        self.step = step
        self.checkpoint_step = checkpoint_step
        self.note = note
        self.abandoned = abandoned
        super().__init__(self.message())

    def saved(self, step: int, checkpoint_step: Optional[int]) -> "RunInterrupted":
        """The same interruption, as the loop reports it: at ``step`` (the last completed one), with the checkpoint
        it wrote on the way out (None: none could be written)."""
        return RunInterrupted(self.signum, step=step, checkpoint_step=checkpoint_step, note=self.note,
                              abandoned=self.abandoned)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal_name(self.signum)

    def message(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        if self.checkpoint_step is not None:
            saved = f"final checkpoint of step {self.checkpoint_step} written; the same command resumes from it"
            if self.abandoned:  # the checkpoint of the last completed step: the cut one is done again
                saved += f" and repeats step {self.checkpoint_step + 1}"
            if self.note:
                saved = f"{self.note}: {saved}"
        elif self.abandoned:
            saved = f"{self.note}: stopped without a final checkpoint (the last one written, if any, is intact)"
        else:
            saved = self.note or "no final checkpoint (the last one written, if any, is intact)"
        return f"interrupted by {self.signal_name}{where}; {saved}"

    def record(self) -> dict[str, Any]:
        """What summary.json records about the interruption."""
        return {"signal": self.signal_name, "signum": self.signum, "step": self.step,
                "checkpoint_step": self.checkpoint_step}


class StopRequests:
    """Handlers for SIGTERM/SIGINT for as long as a run lives in this process (``with StopRequests():``).

    The training loop calls :meth:`defer` around its steps and :meth:`requested` at each step boundary. Only the
    main thread can install handlers; elsewhere (e.g. a thread of a test) this is a no-op."""

    current: Optional["StopRequests"] = None

    def __init__(self, grace_s: Optional[float] = None):
        self.grace_s = float(os.environ.get(GRACE_ENV, GRACE_S) if grace_s is None else grace_s)
        self.signum: Optional[int] = None
        self.first_at = 0.0
        self.deferring = False
        self.polling = False  # record only (see polled)
        self.shielding = False  # record only, unless repeated (see shielded)
        self.received = 0  # signals received so far (a waiting driver passes each new one on)
        self.last_signum: Optional[int] = None
        self.expired = False
        self._expiring = False  # set by the grace timer just before it interrupts the main thread
        self._previous: dict[int, Any] = {}
        self._timer: Optional[threading.Timer] = None
        self._installed = False

    # ---------------------------------------------------------------- install
    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            self._installed = True
            StopRequests.current = self
        return self

    def reinstall(self) -> None:
        """Take the signals back from a library that installed its own handlers (Ray's driver aborts on SIGTERM)."""
        if self._installed and threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, self._handle)

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._installed:
            for s, handler in self._previous.items():
                signal.signal(s, handler)
            if StopRequests.current is self:
                StopRequests.current = None
            self._installed = False

    # ---------------------------------------------------------------- signals
    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        self.received += 1
        self.last_signum = signum
        if self.polling:  # the waiting loop polls and passes it on: nothing may be raised inside its library calls
            if self.signum is None:
                self.signum, self.first_at = signum, now
            return
        if self.shielding and (self.signum is None or now - self.first_at < _REPEAT_S):
            if self.signum is None:
                self.signum, self.first_at = signum, now
                print(f"stalerl: {signal_name(signum)} received after the last step: finishing the run's final "
                      "save (a second signal stops at once)", flush=True)
            return
        if self.signum is not None:
            if self._expiring:  # the grace timer's call: the loop saves its last completed step on the way out
                self._expiring = False
                raise RunInterrupted(self.signum, note=f"the step did not end within {self.grace_s:g}s",
                                     abandoned=True)
            if now - self.first_at < _REPEAT_S:
                return  # the same request twice (e.g. from Slurm and from the job's shell)
            raise RunInterrupted(self.signum, note="stopped at once by a second signal, without a final "
                                                   "checkpoint (the last one written, if any, is intact)")
        self.signum, self.first_at = signum, now
        if not self.deferring:
            raise RunInterrupted(signum)
        print(f"stalerl: {signal_name(signum)} received: stopping after this step (at most {self.grace_s:g}s)",
              flush=True)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        import _thread

        self.expired = True
        if self.shielding:  # the final save is under way: let it end (the marker is written last)
            return
        self._expiring = True
        _thread.interrupt_main(self.signum)  # runs _handle in the main thread, which then raises

    # ---------------------------------------------------------------- the loop's side
    def requested(self) -> Optional[int]:
        return self.signum


def current() -> Optional[StopRequests]:
    return StopRequests.current


class _Flag:
    """Base of :class:`deferred`, :class:`polled` and :class:`shielded`: sets one of StopRequests' flags for a block."""

    flag = ""

    def __enter__(self) -> "_Flag":
        self.stop = StopRequests.current
        if self.stop is not None:
            self.was = getattr(self.stop, self.flag)
            setattr(self.stop, self.flag, True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stop is not None:
            setattr(self.stop, self.flag, self.was)


class deferred(_Flag):
    """``with deferred():`` a signal inside asks for a stop at the next :func:`stop_requested` check instead of
    stopping at once (the training steps)."""

    flag = "deferring"


class polled(_Flag):
    """``with polled():`` a signal inside is only recorded; the block polls :func:`signals_received` and acts (a
    driver waiting on a Ray task or a sweep's run passes it on and waits for that to stop)."""

    flag = "polling"


class shielded(_Flag):
    """``with shielded():`` the end of a run (final checkpoint, final model, completion marker) is not cut by the
    first signal or by the grace timer; a second signal still stops at once."""

    flag = "shielding"


def signals_received() -> tuple[int, Optional[int]]:
    """(how many SIGTERM/SIGINT this run's process has received, the last one)."""
    stop = StopRequests.current
    return (0, None) if stop is None else (stop.received, stop.last_signum)


def stop_requested() -> Optional[int]:
    """The signal that asked this run to stop, or None."""
    stop = StopRequests.current
    return None if stop is None else stop.requested()


def stop_now(signum: Optional[int] = None, **kwargs: Any) -> RunInterrupted:
    stop = StopRequests.current
    if stop is not None and stop._timer is not None:
        stop._timer.cancel()
    return RunInterrupted(signum if signum is not None else (stop_requested() or signal.SIGTERM), **kwargs)




# Test hook: STALERL_TEST_PAUSE="<phase>@<step>:<seconds>" pauses the run once, in ``phase`` ("generation": after the
# step's batch was generated; "update": after the update's first optimizer step) of step ``step`` (the step whose
# metrics row is ``step``), and creates the file STALERL_TEST_PAUSE_MARK then, so a test can land a real signal
# there and let the grace run out mid-step (tests/e2e/test_stop_keeps_work.py). Unset (always, outside those tests):
# nothing happens.
PAUSE_ENV = "STALERL_TEST_PAUSE"
PAUSE_MARK_ENV = "STALERL_TEST_PAUSE_MARK"
_paused: set[str] = set()


def pause_for_test(phase: str, step: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    where, _, seconds = spec.partition(":")
    if where != f"{phase}@{step}" or where in _paused:
        return
    _paused.add(where)
    mark = os.environ.get(PAUSE_MARK_ENV)
    if mark:
        with open(mark, "w") as fh:
            fh.write(f"{where}\n")
    end = time.monotonic() + float(seconds or 60)
    while time.monotonic() < end:  # short sleeps: the grace timer's interruption is handled within 50 ms
        time.sleep(0.05)
