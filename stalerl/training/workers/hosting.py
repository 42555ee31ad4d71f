"""Where worker objects live: local processes (``scheduler.type=local``) or Ray actors (``scheduler.type=ray``).

Both hostings give the controller the same things: ``spawn`` a worker object from (module, class, kwargs) with a
resource request, asynchronous ``call``s whose answers arrive on ``results`` as ``(role, kind, call_id, out)``
(kind: ready | ok | error), ``failure()`` per worker, ``share`` for a weight set every rollout worker reads
(shared memory locally, the Ray object store on Ray), and the address train rank 0 listens on.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from stalerl.core.errors import UserError
from stalerl.training.workers.process import CTX, WorkerFailure, WorkerProcess, _maybe_inject_fault


@dataclass(frozen=True)
class Resources:
    cpus: float = 1.0
    gpus: float = 0.0


class LocalHosting:
    name = "local"

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.results = CTX.Queue()

    def reserve(self, role: str, count: int, resources: Resources) -> None:
        """Nothing to reserve on one machine (the OS schedules the processes)."""

    def spawn(self, role: str, module: str, cls_name: str, kwargs: dict, resources: Resources,
              gpu: Optional[int] = None, env: Optional[dict[str, str]] = None) -> WorkerProcess:
        """``gpu``: the device index this worker owns (CUDA_VISIBLE_DEVICES), so ranks never share a GPU (None:
        inherit this process's devices, as cluster.share_gpu does). ``env``: more variables for the child (e.g. its
        share_gpu memory cap), set before it initialises CUDA."""
        child_env = dict(env or {})
        if gpu is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        return WorkerProcess(role, module, cls_name, kwargs, self.results, self.log_dir, env=child_env)

    def share(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fresh shared-memory copies per version: a worker never reads a buffer that is being overwritten."""
        try:
            return {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in state.items()}
        except RuntimeError as exc:
            if "shared memory" not in str(exc) and "No space left" not in str(exc):
                raise
            remove_own_shm_segments()  # torch leaves the segment it could not size behind
            raise shm_error(state_bytes(state), "ran out while publishing weights") from exc

    def check_shared_memory(self, state: dict[str, torch.Tensor]) -> None:
        """Before any work: /dev/shm must hold SHM_COPIES copies of the weights (the version being published and the
        one a worker may still be reading), or the run is refused naming rollout.weight_sync=disk."""
        need = SHM_COPIES * state_bytes(state)
        free = shm_free_bytes()
        if free is not None and free < need:
            raise shm_error(state_bytes(state), f"has {free / 2**20:.1f} MiB free")

    def host_address(self) -> str:
        return "127.0.0.1"

    def close(self) -> None:
        pass


SHM_DIR = "/dev/shm"
SHM_COPIES = 2


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def shm_free_bytes() -> Optional[int]:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:  # no /dev/shm (not Linux): torch finds its own way, nothing to check
        return None
    return st.f_bavail * st.f_frsize


def shm_error(weights: int, what: str) -> UserError:
    from stalerl.core.errors import ResourceError

    return ResourceError(
        f"rollout.weight_sync=shared_memory needs about {SHM_COPIES * weights / 2**20:.1f} MiB in {SHM_DIR} "
        f"({SHM_COPIES} copies of the {weights / 2**20:.1f} MiB of weights) and {SHM_DIR} {what}; use "
        f"rollout.weight_sync=disk (weights through files in the run directory), or enlarge {SHM_DIR} (e.g. docker "
        "run --shm-size=...)")


def remove_own_shm_segments() -> None:
    """torch names its segments torch_<pid>_...; remove this process's (a failed allocation leaves one)."""
    prefix = f"torch_{os.getpid()}_"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


# --------------------------------------------------------------------------------------------------- Ray
def import_ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError('scheduler.type=ray needs Ray: pip install "stalerl[ray]"') from exc
    return ray


def init_ray(address: Optional[str] = None, *, log_to_driver: bool = True) -> bool:
    """Connect to ``address``, else ``RAY_ADDRESS``, else start a local cluster. Returns True when this call did it
    (the caller then owns ``ray.shutdown()``), False when Ray was already initialised in this process."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
    else:
        # Ray's notice that the local cluster it starts uses token authentication (its default, kept) is noise on
        # every run's console; the cluster lives and dies with this process.
        import logging

        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(include_dashboard=False, log_to_driver=log_to_driver, configure_logging=False)
    from stalerl.core.interrupt import current

    stop = current()
    if stop is not None:  # ray.init installs a SIGTERM handler that aborts the driver: the run's own comes back
        stop.reinstall()
    return True


class _RayWorkerHost:
    """The body of the Ray actor: builds the worker object, serves calls in submission order."""

    def __init__(self, role: str, module: str, cls_name: str, kwargs: dict, log_path: str):
        import importlib
        import sys

        log = open(log_path, "a", buffering=1)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        import signal

        # Ctrl-C reaches a terminal's whole process group, Ray's workers too: only the controller stops the run.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.role = role
        self.worker = getattr(importlib.import_module(module), cls_name)(**kwargs)

    def ready(self) -> int:
        return os.getpid()

    def call(self, method: str, args: tuple) -> Any:
        import ray

        _maybe_inject_fault(self.role, method)
        # Refs nested in the argument tuple are not resolved by Ray: fetch them (the shared weight set).
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        return getattr(self.worker, method)(*args)


class RayWorker:
    """Handle of one Ray actor, with the same interface as :class:`WorkerProcess`."""

    def __init__(self, hosting: "RayHosting", role: str, actor, log_path: Path):
        self.hosting = hosting
        self.role = role
        self.actor = actor
        self.log_path = log_path
        self._next_call = 0
        self._failure: Optional[WorkerFailure] = None
        hosting._track(self, actor.ready.remote(), 0, kind="ready")

    def call(self, method: str, *args: Any) -> int:
        self._next_call += 1
        self.hosting._track(self, self.actor.call.remote(method, args), self._next_call)
        return self._next_call

    def failure(self) -> Optional[WorkerFailure]:
        return self._failure

    def stop(self, timeout: float = 10.0) -> None:
        ray = import_ray()
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass


class RayHosting:
    """Ray actors in one placement group per role (PACK: a role's workers go to as few nodes as possible)."""

    name = "ray"

    def __init__(self, log_dir: Path, *, address: Optional[str] = None, placement_timeout_s: float = 60.0):
        ray = import_ray()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.results: queue.Queue = queue.Queue()
        self.placement_timeout_s = placement_timeout_s
        # Worker output goes to per-role log files, not to the driver's terminal.
        self.started_cluster = init_ray(address, log_to_driver=False)
        self.groups: dict[str, Any] = {}
        self._pending: dict[Any, tuple[RayWorker, int, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="ray-poller", daemon=True)
        self._poller.start()
        self._actor_cls = ray.remote(_RayWorkerHost)

    # ---------------------------------------------------------------- placement
    def reserve(self, role: str, count: int, resources: Resources) -> None:
        """A placement group for ``count`` workers of ``role``; fails fast with what was asked and what exists."""
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        if count == 0:
            return
        bundle = {"CPU": resources.cpus}
        if resources.gpus:
            bundle["GPU"] = resources.gpus
        asked = {k: v * count for k, v in bundle.items()}
        total = ray.cluster_resources()
        short = {k: (v, total.get(k, 0.0)) for k, v in asked.items() if v > total.get(k, 0.0)}
        if short:
            need = ", ".join(f"{k}: asked {v:g}, cluster has {have:g}" for k, (v, have) in short.items())
            raise UserError(f"cannot place {count} x {role} workers ({bundle} each) on this Ray cluster: {need}. "
                               "Shrink the backend (rollout.backend / actor.backend), torch_threads, or add nodes.")
        pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK", name=f"stalerl-{role}")
        ready = pg.ready()
        done, _ = ray.wait([ready], timeout=self.placement_timeout_s)
        if not done:
            remove_placement_group(pg)
            raise RuntimeError(f"placing {count} x {role} workers ({bundle} each) timed out after "
                               f"{self.placement_timeout_s:.0f}s; available now: {ray.available_resources()}, "
                               f"cluster: {total}")
        self.groups[role] = pg

    def spawn(self, role: str, module: str, cls_name: str, kwargs: dict, resources: Resources,
              gpu: Optional[int] = None, env: Optional[dict[str, str]] = None) -> RayWorker:
        """``gpu`` is ignored: Ray assigns each actor its GPUs (and sets CUDA_VISIBLE_DEVICES). ``env`` must be empty
        (cluster.share_gpu, its only user, is refused with Ray by the config rules)."""
        if env:
            raise ValueError(f"RayHosting.spawn: env {sorted(env)} is not supported on Ray (cluster.share_gpu needs "
                             "scheduler.type=local)")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        family, _, index = role.partition("/")
        pg = self.groups.get(family)
        options: dict[str, Any] = {"num_cpus": resources.cpus, "num_gpus": resources.gpus, "max_restarts": 0,
                                   "name": None}
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=int(index or 0) % pg.bundle_count)
        log_path = self.log_dir / f"{role.replace('/', '-')}.log"
        actor = self._actor_cls.options(**options).remote(role, module, cls_name, kwargs, str(log_path))
        return RayWorker(self, role, actor, log_path)

    def share(self, state: dict[str, torch.Tensor]):
        """One copy in the object store; every worker's call receives it by reference."""
        ray = import_ray()
        return ray.put({k: v.detach().cpu() for k, v in state.items()})

    def host_address(self) -> str:
        ray = import_ray()
        return ray.util.get_node_ip_address()

    # ---------------------------------------------------------------- results
    def _track(self, worker: RayWorker, ref, call_id: int, kind: str = "ok") -> None:
        with self._lock:
            self._pending[ref] = (worker, call_id, kind)

    def _poll(self) -> None:
        ray = import_ray()
        while not self._stop.is_set():
            with self._lock:
                refs = list(self._pending)
            if not refs:
                time.sleep(0.01)
                continue
            done, _ = ray.wait(refs, num_returns=1, timeout=0.05)
            for ref in done:
                with self._lock:
                    worker, call_id, kind = self._pending.pop(ref)
                try:
                    out = ray.get(ref)
                    self.results.put((worker.role, kind, call_id, out))
                except Exception as exc:  # noqa: BLE001 - the actor's error, reported as the worker's failure
                    dead = type(exc).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
                    message = str(exc)
                    worker._failure = WorkerFailure(worker.role, None,
                                                    ("the actor died: " if dead else "") + message, worker.log_path)
                    self.results.put((worker.role, "error", call_id, message))

    def close(self) -> None:
        ray = import_ray()
        self._stop.set()
        self._poller.join(2)
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        if self.started_cluster:
            ray.shutdown()


def make_hosting(scheduler: Any, log_dir: Path):
    """The worker processes' hosting for the config's ``scheduler`` section."""
    if scheduler.type == "ray":
        return RayHosting(log_dir, address=scheduler.ray_address)
    return LocalHosting(log_dir)


def worker_resources(cfg: Any) -> Resources:
    """Per worker: torch_threads CPUs, and one GPU when the actor runs on CUDA."""
    gpus = 1.0 if cfg.actor.device == "cuda" or (cfg.actor.device == "auto" and torch.cuda.is_available()) else 0.0
    return Resources(cpus=float(cfg.torch_threads), gpus=gpus)
