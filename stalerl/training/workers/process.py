"""Hosting a worker object in a local process: a command queue in, a shared result queue out, a log file.

The worker class is built in the child from ``(module, class name, kwargs)`` and then serves method calls in order.
A raised exception is sent back with its traceback and the child exits with code 1, so the controller can stop the
run with the worker's own message; a child that dies without a word (segfault, OOM kill) is noticed through its exit
code. stdout/stderr of the child go to its log file, whose tail is quoted in failures.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.multiprocessing as mp

CTX = mp.get_context("spawn")


@dataclass
class WorkerFailure(Exception):
    role: str
    exit_code: Optional[int]
    message: str
    log_path: Optional[Path] = None
    # The worker's exception class name (e.g. "NonFiniteLogProbError"), so the controller can tell a kind of failure
    # by type; None for a process that died without raising.
    exc_type: Optional[str] = None

    def __str__(self) -> str:
        code = "still running" if self.exit_code is None else f"exit code {self.exit_code}"
        tail = log_tail(self.log_path) if self.log_path else ""
        return (f"worker {self.role} failed ({code}): {self.message}"
                + (f"\n--- last lines of {self.log_path} ---\n{tail}" if tail else ""))


def failure_exit_code(failure: WorkerFailure) -> int:
    code = failure.exit_code
    if code is None or code == 0:
        return 1
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as a shell reports it


def log_tail(path: Optional[Path], lines: int = 30) -> str:
    if path is None or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the controller dies, even by SIGKILL, so no orphan keeps a GPU or a port."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def ignore_stop_signals() -> None:
    """A worker ignores SIGINT and SIGTERM: Ctrl-C reaches a terminal's whole process group and Slurm signals every
    process of a job, but only the controller decides how the run stops (stalerl.core.interrupt); it then stops its
    workers, and a worker whose controller is gone gets SIGKILL (_die_with_parent)."""
    import signal

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def _child_main(role: str, module: str, cls_name: str, kwargs: dict, commands, results, log_path: str,
                parent_pid: int, env: dict[str, str]) -> None:
    os.environ.update(env)  # e.g. CUDA_VISIBLE_DEVICES: before the worker initialises CUDA
    _die_with_parent()
    ignore_stop_signals()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    try:
        from stalerl.training.share_gpu import apply_fraction_from_env

        apply_fraction_from_env()  # cluster.share_gpu: this process's cap on the shared device, before its model
        worker = getattr(importlib.import_module(module), cls_name)(**kwargs)
        results.put((role, "ready", None, None))
        while True:
            call_id, method, args = commands.get()
            if method == "__stop__":
                break
            _maybe_inject_fault(role, method)
            out = getattr(worker, method)(*args)
            results.put((role, "ok", call_id, out))
    except BaseException as exc:  # noqa: BLE001 - report everything, then exit non-zero
        tb = traceback.format_exc()
        print(tb, flush=True)
        try:
            results.put((role, "error", None, f"{type(exc).__name__}: {exc}\n{tb}"))
            # os._exit skips the queue's feeder thread: flush the message through the pipe first.
            results.close()
            results.join_thread()
        finally:
            log.flush()
            os._exit(1)
    log.flush()


_calls: dict[str, int] = {}


def _maybe_inject_fault(role: str, method: str) -> None:
    """Test hook: STALERL_INJECT_FAULT="rollout/0:generate:3" raises in that worker's 3rd call of that method."""
    spec = os.environ.get("STALERL_INJECT_FAULT")
    if not spec:
        return
    want_role, want_method, nth = spec.rsplit(":", 2)
    if role != want_role or method != want_method:
        return
    _calls[method] = _calls.get(method, 0) + 1
    if _calls[method] == int(nth):
        raise RuntimeError(f"injected fault in {role}.{method} call {nth} (STALERL_INJECT_FAULT)")


class WorkerProcess:
    """One worker object in its own process. Calls are asynchronous: ``call`` returns a call id and the answer
    arrives on the shared results queue as ``(role, "ok", call_id, result)``."""

    def __init__(self, role: str, module: str, cls_name: str, kwargs: dict, results, log_dir: Path,
                 env: Optional[dict[str, str]] = None):
        self.role = role
        self.log_path = Path(log_dir) / f"{role.replace('/', '-')}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.commands = CTX.Queue()
        self._next_call = 0
        self.process = CTX.Process(target=_child_main, name=role, daemon=True,
                                   args=(role, module, cls_name, kwargs, self.commands, results, str(self.log_path),
                                         os.getpid(), dict(env or {})))
        self.process.start()

    def call(self, method: str, *args: Any) -> int:
        self._next_call += 1
        self.commands.put((self._next_call, method, args))
        return self._next_call

    _stopping = False

    def failure(self) -> Optional[WorkerFailure]:
        """A WorkerFailure if the process has exited without being asked to stop (whatever its exit code)."""
        code = self.process.exitcode
        if code is None or self._stopping:
            return None
        return WorkerFailure(self.role, code, "the process exited unexpectedly", self.log_path)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if not self.process.is_alive():
            # Nobody will read what is still queued for a dead worker: without this the queue's feeder thread
            # blocks on the full pipe and the interpreter hangs at exit joining it.
            self.commands.cancel_join_thread()
        if self.process.is_alive():
            try:
                self.commands.put((0, "__stop__", ()))
            except Exception:  # noqa: BLE001
                pass
            self.process.join(timeout)
        if self.process.is_alive():  # (SIGTERM is ignored by workers: see ignore_stop_signals)
            self.process.kill()
            self.process.join(5)
        self.commands.cancel_join_thread()
        self.commands.close()
