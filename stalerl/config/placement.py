"""Where a run's compute threads go: one line a run logs at its start (issue 43 item 5).

A synchronous run computes in one process; an asynchronous one in its rollout workers (``rollout.backend``'s dX) and
train workers (``actor.backend``'s dY), its controller mostly waiting. Every compute process sets
``torch.set_num_threads(torch_threads)``, so the run asks for processes x torch_threads threads. On a CPU run more
threads than the machine's CPUs make the processes take turns on the same cores, and on 2 cores even one thread each
leaves async d1+d1 at about the synchronous loop's speed (docs/algorithms/m2po.md, "Asynchronous rollouts on 2
cores"). Torch-free.

Oversubscribed cores cost more than their share under libgomp's default wait policy: a thread that reaches a barrier
first spins on its core while its sibling, descheduled for another process's thread, cannot finish (one SmolLM2 run,
2 threads, the other core busy: 234 s spinning, 36 s with ``OMP_WAIT_POLICY=PASSIVE``, the same metrics). So where a
run's own worker processes oversubscribe this machine, their OpenMP threads wait passively
(:func:`passive_wait_for_workers`); a wait policy changes no result.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from stalerl.config.backend import ROLLOUT_ENGINES, TRAIN_ENGINES, is_async, parse_backend


def compute_processes(cfg: Any) -> dict[str, int]:
    """Role -> compute processes: ``{"trainer": 1}`` for a synchronous run, else ``{"rollout": X, "train": Y}``."""
    if not is_async(cfg):
        return {"trainer": 1}
    return {"rollout": parse_backend(cfg.rollout.backend, engines=ROLLOUT_ENGINES, key="rollout.backend").dp,
            "train": parse_backend(cfg.actor.backend, engines=TRAIN_ENGINES, key="actor.backend").dp}


def compute_threads(cfg: Any) -> int:
    """Threads the run's compute processes ask for: each sets ``torch.set_num_threads(torch_threads)``."""
    return cfg.torch_threads * sum(compute_processes(cfg).values())


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a Slurm allocation or taskset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def placement_line(cfg: Any, cpus: Optional[int] = None) -> str:
    """``stalerl: placement: ...``: each role's processes x threads, the total against the CPUs here, and, when that
    total is larger, that the processes share cores and how many threads per process would not."""
    cpus = available_cpus() if cpus is None else cpus
    roles = compute_processes(cfg)
    t, processes = cfg.torch_threads, sum(roles.values())
    parts = ", ".join(f"{role} {n} process{'es' if n > 1 else ''} x {t} thread{'s' if t > 1 else ''}"
                      for role, n in roles.items())
    threads = compute_threads(cfg)
    line = f"stalerl: placement: {parts} (torch_threads={t}) = {threads} threads on {cpus} CPUs"
    if threads > cpus:
        fit = max(1, cpus // processes)
        line += (f"; oversubscribed: the processes take turns on the same cores (torch_threads={fit} gives each "
                 "process cores of its own" + (", not possible here: more processes than CPUs" if processes > cpus
                                               else "") + ")")
    return line


#: libgomp's wait policy variable, read once when a process loads the OpenMP runtime (at ``import torch``).
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def passive_wait_for_workers(cfg: Any, cpus: Optional[int] = None,
                             environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (default ``os.environ``, which the worker processes spawned
    after this inherit) when the run's worker processes oversubscribe the CPUs here, and return the line saying so.
    None, setting nothing, when the run has no worker processes (the synchronous loop: one process, whose OpenMP
    runtime is loaded already), its placement fits, its workers are Ray actors (their environment is the cluster's),
    or the variable is set (the user's choice, kept)."""
    environ = os.environ if environ is None else environ
    cpus = available_cpus() if cpus is None else cpus
    threads = compute_threads(cfg)
    if "trainer" in compute_processes(cfg) or threads <= cpus or cfg.scheduler.type == "ray" or WAIT_POLICY_ENV in environ:
        return None
    environ[WAIT_POLICY_ENV] = "PASSIVE"
    return (f"stalerl: placement: {WAIT_POLICY_ENV}=PASSIVE for the worker processes ({threads} threads on {cpus} "
            "CPUs): an OpenMP thread waiting at a barrier sleeps instead of spinning on a core another worker needs; "
            f"a wait policy, no result changes (set {WAIT_POLICY_ENV} to choose it yourself)")
