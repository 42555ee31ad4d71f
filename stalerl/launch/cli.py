"""The command line of the main job (``examples/math/gsm8k_rl.py`` and ``python -m stalerl.cli``, which forwards here).

    python3 examples/math/gsm8k_rl.py --config FILE.yaml [key=value ...] [key=a,b,c ...] [--dry-run] [--plot] [--debug]

A ``key=a,b,c`` override makes it a sweep over the grid of values (see :mod:`stalerl.results.sweep`). Every config of a
sweep is loaded and validated before the first run starts. A bare or relative ``--config`` that is not found from
the current directory is looked up next to the script and among the example configs (:mod:`stalerl.launch.config_lookup`).

User errors (config, data, model, resources, trial directory) print one line, ``stalerl: error: ...``, and exit
with code 2; ``--debug`` shows their traceback. torch, transformers and Ray are imported only when a run starts,
so ``--help`` and ``--dry-run`` return at once (``bench/cli_startup.py`` measures it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

from stalerl.config import ConfigError, ExperimentConfig, format_help, load_config, parse_args, run_dir
from stalerl.launch.config_lookup import resolve_config_path
from stalerl.core.errors import EXIT_USER_ERROR, UserError
from stalerl.core.launch_env import LAUNCH_TIME_ENV, MALLOC_MMAP_THRESHOLD_ENV, configure_allocator, parse_mmap_threshold
from stalerl.launch.launcher import launch
from stalerl.results.sweep import expand, is_sweep, summarize_run, sweep_axes, write_summary

DEBUG_FLAG = "--debug"
EXTRA_HELP = ("  --debug              show the traceback of a user error (config, data, model, resources, trial "
              "directory),\n                       which otherwise prints as one line with exit code 2")


def main(argv: Optional[list[str]] = None) -> int:
    as_program = argv is None  # the process's own command line: this process ends when main returns
    argv = sys.argv[1:] if argv is None else list(argv)
    # Python block-buffers stdout that is not a terminal: a log file or pipe would get the step lines in bursts and
    # after the progress lines on stderr. Whole lines as they happen keep such a log readable in order.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    from stalerl.core.interrupt import RunInterrupted

    try:
        return _main(argv, debug=debug)
    except RunInterrupted as stop:  # SIGTERM/SIGINT (stalerl.core.interrupt): one line, exit 128 + signal
        if debug:
            raise
        print(f"stalerl: {stop}", file=sys.stderr, flush=True)
        if as_program:
            _ignore_late_stop_signals()
        return stop.exit_code
    except Exception as err:  # noqa: BLE001 - only user errors are caught; anything else is re-raised (a bug)
        if debug or not isinstance(err, _user_error_types()):
            raise
        print(f"stalerl: error: {one_line(err)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


def _ignore_late_stop_signals() -> None:
    """The run has stopped for a signal and said so: a repeat of it arriving later (a sweep passing on the Ctrl-C its
    run also got from the terminal's process group, seconds later on a busy machine) must not interrupt the
    interpreter's shutdown, where the default SIGINT handler would raise KeyboardInterrupt inside an exit handler and
    print its traceback after the one line."""
    import signal

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _user_error_types() -> tuple[type, ...]:
    """Config/user errors, and Slurm's (sbatch missing or rejecting the job: a scheduler precondition) when the
    Slurm scheduler was used (its module is only imported then)."""
    types: tuple[type, ...] = (ConfigError, UserError)
    slurm = sys.modules.get("stalerl.schedulers.slurm")
    return types + ((slurm.SlurmError,) if slurm is not None else ())


def one_line(err: BaseException) -> str:
    """A multi-problem config error on one line (problems separated by '; ')."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return lines[0] + " " + "; ".join(ln.lstrip("- ") for ln in lines[1:])
    return " ".join(lines)


def _main(argv: list[str], *, debug: bool = False) -> int:
    # When the job was launched, for the start-up overhead metric (inherited by workers, tasks and Slurm jobs).
    os.environ.setdefault(LAUNCH_TIME_ENV, repr(time.time()))
    config_path, overrides, flags = parse_args(argv)
    if flags.get("help"):
        print(format_help(extra_flags=(DEBUG_FLAG,)))
        print(EXTRA_HELP)
        return 0
    if config_path is not None:
        found = resolve_config_path(config_path)
        if found != config_path:
            print(f"stalerl: config {config_path} -> {found}", file=sys.stderr, flush=True)
        config_path = found
    dry_run = bool(flags.get("dry_run"))
    if os.environ.get(MALLOC_MMAP_THRESHOLD_ENV):  # an opt-in allocator rule (stalerl.core.launch_env): less RSS, slower
        try:
            parse_mmap_threshold(os.environ[MALLOC_MMAP_THRESHOLD_ENV])
        except ValueError as exc:  # checked before any work, one line
            raise UserError(str(exc)) from exc
        if not dry_run:  # before torch is imported; sweep tasks and workers inherit it
            print(f"stalerl: {configure_allocator()}", file=sys.stderr, flush=True)
    if is_sweep(overrides):
        return run_sweep(config_path, overrides, dry_run=dry_run, debug=debug)
    cfg = load_config([*_config_args(config_path), *overrides])
    if cfg.scheduler.type == "slurm":  # sbatch; inside the job this CLI runs again with scheduler.type=ray/local
        from stalerl.schedulers.slurm import launch as launch_slurm

        return launch_slurm(cfg, config_path, overrides, dry_run)
    if dry_run:  # print the resolved config; nothing heavy is imported
        launch(cfg, dry_run=True)
        return 0
    from stalerl.training.workers.process import WorkerFailure, failure_exit_code

    start = time.time()
    try:
        launch(cfg, plot=bool(flags.get("plot")))
    except WorkerFailure as failure:  # a rollout or train worker raised or died: its code and log tail
        print(f"stalerl: {failure}", file=sys.stderr)
        return failure_exit_code(failure)
    from stalerl.results.run_summary_console import first_eval_accuracy, format_run_summary, summary_row

    rd = run_dir(cfg)
    print(format_run_summary(summary_row(rd), rd, wall_s=time.time() - start, first_eval=first_eval_accuracy(rd)),
          flush=True)
    return 0


def _config_args(config_path: Optional[str]) -> list[str]:
    return ["--config", config_path] if config_path else []


def run_sweep(config_path: Optional[str], overrides: list[str], *, dry_run: bool = False,
              debug: bool = False) -> int:
    fixed, axes = sweep_axes(overrides)
    if any(k == "scheduler.type" for k, _ in axes):
        raise UserError("scheduler.type cannot be swept: a sweep runs under one scheduler")
    base = load_config([*_config_args(config_path), *fixed])
    runs = expand(overrides, base.trial_name)
    configs = [load_config([*_config_args(config_path), *ovr]) for _, ovr in runs]  # all validated up front
    print(f"sweep: {len(runs)} runs over {', '.join(k for k, _ in axes)} (scheduler.type={base.scheduler.type})")
    for trial, ovr in runs:
        print(f"  {trial}")
    if dry_run:
        if base.scheduler.type == "slurm":  # also print the job array's sbatch script
            from stalerl.schedulers.slurm import run_sweep as slurm_sweep

            slurm_sweep(config_path, runs, configs, dry_run=True)
        return 0
    kind = base.scheduler.type
    from stalerl.launch.preflight import check_before_launch

    for cfg in configs if kind != "slurm" else []:  # (a Slurm job's paths are checked inside the job)
        check_before_launch(cfg)  # paths and device of every point before the first starts
    if kind == "local":
        statuses, signum = _run_local(config_path, runs, debug=debug)
    else:
        statuses, signum = run_sweep_on(kind, config_path, runs, configs)
    rows = [summarize_run(run_dir(cfg), status) for cfg, status in zip(configs, statuses)]
    out = write_summary(rows, run_dir(base).parent)
    print(out.read_text())
    print(f"sweep summary written to {out}")
    if signum is not None:  # the interrupted run printed the one line; exit as a process killed by the signal
        return 128 + signum
    return 0 if all(s == "ok" for s in statuses) else 1


def _run_local(config_path: Optional[str], runs: list[tuple[str, list[str]]], *,
               debug: bool = False) -> tuple[list[str], Optional[int]]:
    """One run after another, each in its own process (a failed run does not stop the sweep). A SIGTERM/SIGINT is
    passed on to the run in progress, which stops cleanly; the runs after it are not started. Returns the statuses
    and that signal (None when none came)."""
    from stalerl.core.interrupt import StopRequests, polled, stop_requested
    from stalerl.launch.launcher import run_child_passing_signals

    statuses: list[str] = []
    with StopRequests(), polled():  # a signal between two runs is recorded too: the next one is not started
        for i, (trial, ovr) in enumerate(runs, 1):
            if stop_requested() is not None:
                break
            start = time.perf_counter()
            print(f"[{i}/{len(runs)}] {trial}", flush=True)
            # Each point's start-up overhead counts from its own launch, not from the sweep's (the env is inherited).
            env = {**os.environ, LAUNCH_TIME_ENV: repr(time.time())}
            argv = [sys.executable, "-m", "stalerl.launch.cli", *_config_args(config_path), *ovr,
                    *([DEBUG_FLAG] if debug else [])]
            code, signum = run_child_passing_signals(argv, env)
            status = run_status(code, signum)
            print(f"[{i}/{len(runs)}] {trial}: {status} in {time.perf_counter() - start:.0f}s", flush=True)
            statuses.append(status)
        signum = stop_requested()
    return statuses + ["not run (interrupted)"] * (len(runs) - len(statuses)), signum


# Sweeps under a cluster scheduler. They live here, not in stalerl.launch.launcher, because a Ray sweep runs this
# CLI inside each task: the imports go one way only, cli -> launcher.
def run_sweep_on(kind: str, config_path, runs, configs) -> tuple[list[str], Optional[int]]:
    """Run the sweep's runs under a cluster scheduler; returns one status per run and the signal that interrupted
    the sweep (None when none did). A Slurm job array's tasks each handle their own signal (scancel) as a run does."""
    if kind == "ray":
        return _run_sweep_on_ray(config_path, runs, configs)
    if kind == "slurm":
        from stalerl.schedulers.slurm import run_sweep

        return run_sweep(config_path, runs, configs), None
    raise ValueError(f"unknown scheduler.type {kind!r}")


def run_cpus(cfg: ExperimentConfig) -> float:
    """CPUs one run occupies: torch_threads per process (the controller plus its worker processes)."""
    from stalerl.config.placement import compute_threads

    return float(compute_threads(cfg))


def _run_sweep_on_ray(config_path, runs, configs) -> tuple[list[str], Optional[int]]:
    """Every run as one Ray task holding the CPUs (and GPUs) it needs, so Ray runs as many at once as fit. Inside
    its task a run uses the local scheduler for its own worker processes. A run that could never fit is refused
    before any is submitted. On a local cluster each run's console goes to ``<run_dir>/logs/console.log`` (runs
    proceed at once, so their lines would interleave); the driver prints one status line per run as it ends.
    A SIGTERM/SIGINT to the driver stops the sweep cleanly (see :func:`_wait_for_sweep_tasks`)."""
    from stalerl.launch.preflight import check_ray_fit, ray_is_this_machine
    from stalerl.training.workers.hosting import import_ray, init_ray, worker_resources

    ray = import_ray()
    to_files = ray_is_this_machine(configs[0])
    started = init_ray(configs[0].scheduler.ray_address, log_to_driver=not to_files)
    try:
        have = ray.cluster_resources()
        asks = []
        for (trial, _), cfg in zip(runs, configs):
            ask = {"CPU": run_cpus(cfg), "GPU": worker_resources(cfg).gpus}
            check_ray_fit(ask, have, f"sweep run {trial}", "lower torch_threads or the backends' sizes")
            asks.append(ask)
        refs, logs, pid_paths = [], [], []
        for (trial, overrides), cfg, ask in zip(runs, configs, asks):
            argv = (["--config", str(config_path)] if config_path else []) + [*overrides, "scheduler.type=local"]
            log_path = run_dir(cfg) / "logs" / "console.log" if to_files else None
            # the task writes its pid here once it runs, so that a signal reaches its process (same machine only)
            pid_path = run_dir(cfg) / "logs" / "sweep_task.pid" if to_files else None
            if pid_path is not None:
                pid_path.parent.mkdir(parents=True, exist_ok=True)
                pid_path.unlink(missing_ok=True)
            task = ray.remote(max_calls=1)(_cli_in_task).options(num_cpus=ask["CPU"], num_gpus=ask["GPU"],
                                                                 max_retries=0)
            refs.append(task.remote(argv, str(log_path) if log_path else None, str(pid_path) if pid_path else None))
            logs.append(log_path)
            pid_paths.append(pid_path)
        return _wait_for_sweep_tasks(ray, [trial for trial, _ in runs], refs, logs, pid_paths)
    finally:
        if started:
            ray.shutdown()


def _wait_for_sweep_tasks(ray, trials: list[str], refs: list, logs: list, pid_paths: list
                          ) -> tuple[list[str], Optional[int]]:
    """Each run's status, printed as it ends. A SIGTERM/SIGINT to this driver is only recorded (raised inside
    ``ray.wait`` it would become a ``SystemError``) and passed on to every run still going, which stops as a local
    run does (final checkpoint, ``summary.json`` interrupted); a run Ray has not started yet is cancelled (``not run
    (interrupted)``). The driver waits at most the grace period (plus 30 s) for the runs to stop, then cancels them.
    Returns the statuses in the sweep's order and the signal (None when none came)."""
    from stalerl.core.interrupt import StopRequests, polled, signal_name, signals_received
    from stalerl.launch.launcher import forward_signal, interrupt_grace

    statuses: dict[int, str] = {}
    index = {ref: i for i, ref in enumerate(refs)}
    pending, forwarded, deadline, signum = list(refs), 0, None, None
    with StopRequests(), polled():
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            for ref in done:
                i = index[ref]
                statuses[i] = _sweep_task_status(ray, ref, signum)
                print(f"{trials[i]}: {statuses[i]}" + (f" (log: {logs[i]})" if logs[i] else ""), flush=True)
            received, latest = signals_received()
            if received > forwarded and pending:
                forwarded, signum = received, latest
                for ref in pending:
                    forward_signal(ray, ref, pid_paths[index[ref]], latest)
                if deadline is None:
                    deadline = time.monotonic() + interrupt_grace() + 30.0
            if pending and deadline is not None and time.monotonic() > deadline:
                for ref in pending:
                    ray.cancel(ref, force=True)
                    statuses[index[ref]] = "failed (did not stop in time after the signal: cancelled)"
                break
        if signum is None:
            signum = signals_received()[1]
    if signum is not None:
        print(f"sweep interrupted by {signal_name(signum)}", flush=True)
    return [statuses[i] for i in range(len(refs))], signum


def _sweep_task_status(ray, ref, signum: Optional[int]) -> str:
    try:
        code = ray.get(ref, timeout=0)
    except ray.exceptions.TaskCancelledError:
        return "not run (interrupted)" if signum is not None else "failed (TaskCancelledError)"
    except Exception as exc:  # noqa: BLE001 - one failed run does not stop the sweep
        return f"failed ({type(exc).__name__})"
    return run_status(code, signum)


def run_status(code: int, signum: Optional[int]) -> str:
    """A sweep run's status from its exit code: ``ok``, ``interrupted (SIG...)`` when it exited as the signal that
    stopped the sweep asks (128 + signal), else ``failed (code)``."""
    from stalerl.core.interrupt import signal_name

    if code == 0:
        return "ok"
    if signum is not None and code == 128 + signum:
        return f"interrupted ({signal_name(signum)})"
    return f"failed ({code})"


def _cli_in_task(argv: list[str], log_path: Optional[str] = None, pid_path: Optional[str] = None) -> int:
    # by name: under `python -m stalerl.launch.cli` this module is __main__, whose functions Ray would pickle by value
    from stalerl.launch.cli import main
    from stalerl.launch.launcher import in_ray_task

    with in_ray_task(log_path, pid_path):  # output to the log, pid for the driver's signals, SIGINT unblocked
        return main(argv)


if __name__ == "__main__":
    sys.exit(main())
