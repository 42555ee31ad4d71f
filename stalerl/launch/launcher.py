"""Run a loaded config under its scheduler. ``local`` runs the controller in this process."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from stalerl.config import ExperimentConfig, config_to_yaml, is_async, run_dir
from stalerl.core.interrupt import RunInterrupted


def build_trainer(cfg: ExperimentConfig):
    """The training loop with its rollout source: the asynchronous dX+dY workers under admission control, or the
    synchronous in-process generation (optionally with a fixed-staleness FIFO)."""
    from stalerl.training.trainer import Trainer

    if is_async(cfg):
        from stalerl.training.async_source import AdmissionSource

        return Trainer(cfg, source=AdmissionSource)
    from stalerl.training.sources import FixedStalenessSource

    return Trainer(cfg, source=FixedStalenessSource)


def launch(cfg: ExperimentConfig, *, dry_run: bool = False, plot: bool = False) -> dict[str, Any]:
    if dry_run:
        print(config_to_yaml(cfg))
        return {}
    kind = cfg.scheduler.type
    if kind == "slurm":
        raise NotImplementedError("scheduler.type='slurm' is wired in stalerl.launch.cli")
    from stalerl.core.interrupt import StopRequests
    from stalerl.launch.preflight import check_before_launch
    from stalerl.training.trial_dir import check_trial_dir, lock_trial

    # SIGTERM/SIGINT from here on stop the run cleanly (stalerl.core.interrupt); the trial's lock is held until the
    # run has ended (and released by the kernel if this process is killed), so no two runs share a trial directory.
    with StopRequests():
        check_before_launch(cfg)
        with lock_trial(cfg, run_dir(cfg)):
            check_trial_dir(cfg, run_dir(cfg))
            if kind == "ray" and not is_async(cfg):
                result = _run_sync_on_ray(cfg)
            else:
                result = train_with_summary(cfg)
    if plot:
        from stalerl.results.plot import plot_runs

        out = plot_runs([run_dir(cfg)], ["reward", "actor/grad_norm"], run_dir(cfg) / "curves.png")
        print(f"curves written to {out}")
    return result


def _run_sync_on_ray(cfg: ExperimentConfig) -> dict[str, Any]:
    """The single-process loop (fixed staleness) as one Ray task, with the resources of one worker.

    A request no node set can satisfy is refused at once (Ray would wait forever). The task writes its output to
    ``<run_dir>/logs/trainer.log`` (as worker processes do) and the driver copies that file to its own stdout while
    it waits, so the console reads as in local mode, without Ray's per-line prefixes."""
    from stalerl.launch.preflight import check_ray_fit, ray_is_this_machine
    from stalerl.training.workers.hosting import import_ray, init_ray, worker_resources

    ray = import_ray()
    # On a remote cluster the task's log file is on another node: let Ray forward its output instead.
    tail = ray_is_this_machine(cfg)
    started = init_ray(cfg.scheduler.ray_address, log_to_driver=not tail)
    try:
        res = worker_resources(cfg)
        check_ray_fit({"CPU": res.cpus, "GPU": res.gpus}, ray.cluster_resources(),
                      "the synchronous training loop (one Ray task)",
                      f"torch_threads (CPUs per task, now {cfg.torch_threads}) at most the cluster's CPUs")
        log_path = run_dir(cfg) / "logs" / "trainer.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        # max_calls=1: the worker process exits after the task, so its redirected output never outlives it.
        task = ray.remote(max_calls=1)(_train_in_task).options(num_cpus=res.cpus, num_gpus=res.gpus, max_retries=0)
        pid_path = log_path.with_name("trainer.pid")
        pid_path.unlink(missing_ok=True)
        ref = task.remote(cfg, str(log_path) if tail else None, str(pid_path) if tail else None)
        with open(log_path, "rb") as log:
            log.seek(0, 2)  # this run's output only (an extended trial appends to the same file)
            _follow(ray, ref, log, pid_path)
        try:
            out = ray.get(ref, timeout=0)
        except ray.exceptions.RayTaskError as exc:
            from stalerl.core.errors import UserError

            cause = getattr(exc, "cause", None)
            if isinstance(cause, UserError):  # one line for the user; a bug keeps Ray's remote traceback
                raise cause from None
            raise
        except (ray.exceptions.GetTimeoutError, ray.exceptions.TaskCancelledError):
            ray.cancel(ref, force=True)
            raise RunInterrupted(signal.SIGTERM, note="the task did not stop in time and was cancelled: no final "
                                 "checkpoint (the last one written, if any, is intact)") from None
        if isinstance(out, dict) and INTERRUPTED_KEY in out:
            info = out[INTERRUPTED_KEY]
            raise RunInterrupted(info["signum"], step=info["step"], checkpoint_step=info["checkpoint_step"],
                                 note=info.get("note", ""))
        return out
    finally:
        if started:
            ray.shutdown()


def _copy_new_output(log) -> None:
    import sys

    chunk = log.read()
    if chunk:
        buffer = getattr(sys.stdout, "buffer", None)
        if buffer is not None:
            buffer.write(chunk)
        else:  # a replaced stdout (e.g. a test's capture)
            sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()


INTERRUPTED_KEY = "__stalerl_interrupted__"


def _follow(ray, ref, log, pid_path: Path) -> None:
    """Copy the task's new output to our stdout until it ends. A SIGTERM/SIGINT to this driver is only recorded
    here (raised inside ``ray.wait`` it would become a ``SystemError``): each one is passed on to the task, which
    stops as a local run does; the driver then waits at most the task's grace period (plus 30 s) for it."""
    from stalerl.core.interrupt import polled, signals_received

    forwarded, deadline = 0, None
    with polled():
        while True:
            done, _ = ray.wait([ref], timeout=0.2)
            _copy_new_output(log)
            if done or (deadline is not None and time.monotonic() > deadline):
                return
            received, signum = signals_received()
            if received > forwarded:
                forwarded = received
                forward_signal(ray, ref, pid_path, signum)
                if deadline is None:
                    deadline = time.monotonic() + interrupt_grace() + 30.0


def forward_signal(ray, ref, pid_path: Optional[Path], signum: int) -> None:
    """The task's process gets the signal itself when it runs on this machine (it wrote its pid), else Ray's
    cancellation (a KeyboardInterrupt in the task: SIGINT)."""
    import os

    try:
        os.kill(int(Path(pid_path).read_text()), signum)
        return
    except (OSError, ValueError, TypeError):  # no pid (yet), or not on this machine
        pass
    ray.cancel(ref)


def run_child_passing_signals(argv: list[str], env: dict[str, str]) -> tuple[int, Optional[int]]:
    """Run ``argv`` (a run's own process) to its end; each SIGTERM/SIGINT this process gets meanwhile is passed on
    to it, which stops as a run does (final checkpoint, summary.json ``interrupted``, its one line). A signal the
    child got itself too (Ctrl-C reaches the whole process group) counts once there: it ignores a repeat within a
    second. Call it inside ``StopRequests()`` (the signals are recorded there). Returns (the child's exit code, the
    signal that asked us to stop or None)."""
    import subprocess

    from stalerl.core.interrupt import polled, signals_received, stop_requested

    with polled():
        proc = subprocess.Popen(argv, env=env)
        forwarded, _ = signals_received()
        while True:
            try:
                return proc.wait(timeout=0.2), stop_requested()
            except subprocess.TimeoutExpired:
                pass
            received, signum = signals_received()
            if received > forwarded:
                forwarded = received
                proc.send_signal(signum)


def interrupt_grace() -> float:
    from stalerl.core.interrupt import StopRequests

    return StopRequests().grace_s


@contextlib.contextmanager
def in_ray_task(log_path: Optional[str], pid_path: Optional[str]) -> Iterator[None]:
    """What a run needs inside a Ray task (``_train_in_task``, ``stalerl.launch.cli._cli_in_task``): its output in
    ``log_path``, its pid in ``pid_path`` (the driver signals it there), and SIGINT unblocked for the run. Ray's
    worker blocks SIGINT in its main thread (the mask outlives the task), so without this the driver's forwarded
    Ctrl-C would never reach StopRequests as a SIGTERM does; the mask is restored afterwards."""
    import os
    import sys

    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "a", buffering=1)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout = sys.stderr = out
    if pid_path:
        Path(pid_path).write_text(str(os.getpid()))
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _train_in_task(cfg: ExperimentConfig, log_path: Optional[str], pid_path: Optional[str] = None) -> dict[str, Any]:
    from stalerl.core.interrupt import StopRequests

    with in_ray_task(log_path, pid_path):
        try:
            with StopRequests():  # the driver forwards SIGTERM/SIGINT here (see forward_signal)
                return train_with_summary(cfg)
        except RunInterrupted as exc:  # a BaseException would kill Ray's worker: hand it back as a value
            return {INTERRUPTED_KEY: {**exc.record(), "note": exc.note}}


def train_with_summary(cfg: ExperimentConfig) -> dict[str, Any]:
    """Train, then write ``<run_dir>/summary.json`` (see :mod:`stalerl.results.run_summary`), also when the run fails;
    the experiment trackers (stats_logger.wandb / mlflow) then get the summary and end their runs."""
    from stalerl.results.run_summary import write_run_summary
    from stalerl.results.tracking import finish_trackers

    from stalerl.training.trainer import TrainingDiverged

    def summary(status: str, **kwargs: Any) -> None:
        try:
            write_run_summary(cfg, status=status, wall_s=time.time() - start, **kwargs)
        finally:  # a summary that cannot be written (strict: a full disk) still ends the trackers' runs
            finish_trackers(run_dir(cfg), status, run_dir(cfg) / "summary.json")

    start = time.time()
    try:
        result = build_trainer(cfg).train()
    except TrainingDiverged as exc:  # an outcome of the method, not a failure of the run: its own status
        summary("diverged", error=str(exc)[:2000])
        raise
    except RunInterrupted as exc:  # SIGTERM/SIGINT: stopped on purpose, resumable
        summary("interrupted", error=str(exc)[:2000], extra={"interrupted": exc.record()})
        raise
    except BaseException as exc:
        summary("failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    # strict: a summary that cannot be written (a full disk) fails the run with one line instead of a warning
    summary("finished", strict=True)
    return result
