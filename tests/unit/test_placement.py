"""The placement line a run logs at its start (stalerl.config.placement; issue 43 item 5): processes x threads per
role against the CPUs here, and oversubscription said with the torch_threads that would fit."""

from __future__ import annotations

from stalerl.config import load_config
from stalerl.config.placement import available_cpus, compute_processes, placement_line


def _cfg(*overrides: str):
    return load_config(["--config", "examples/math/gsm8k_m2po_cpu.yaml", *overrides])


def test_sync_run_is_one_process_and_fits():
    cfg = _cfg("torch_threads=2", "rollout.fixed_staleness=4")
    assert compute_processes(cfg) == {"trainer": 1}
    line = placement_line(cfg, cpus=2)
    assert line == "stalerl: placement: trainer 1 process x 2 threads (torch_threads=2) = 2 threads on 2 CPUs"


def test_async_d1_d1_at_two_threads_on_two_cpus_is_oversubscribed_and_says_what_fits():
    cfg = _cfg("torch_threads=2", "rollout.fixed_staleness=0", "rollout.max_head_offpolicyness=1",
               "rollout.backend=hf:d1", "actor.backend=torch:d1")
    assert compute_processes(cfg) == {"rollout": 1, "train": 1}
    line = placement_line(cfg, cpus=2)
    assert line.startswith("stalerl: placement: rollout 1 process x 2 threads, train 1 process x 2 threads "
                           "(torch_threads=2) = 4 threads on 2 CPUs; oversubscribed")
    assert "torch_threads=1 gives each process cores of its own)" in line
    assert "oversubscribed" not in placement_line(cfg, cpus=4)
    one = _cfg("torch_threads=1", "rollout.fixed_staleness=0", "rollout.max_head_offpolicyness=1",
               "rollout.backend=hf:d2", "actor.backend=torch:d1")
    assert compute_processes(one) == {"rollout": 2, "train": 1}
    assert placement_line(one, cpus=2).endswith("not possible here: more processes than CPUs)")


def test_available_cpus_follows_the_affinity_mask():
    import os

    assert available_cpus() == len(os.sched_getaffinity(0)) >= 1


def _async_d1_d1(threads: int, *extra: str):
    return _cfg(f"torch_threads={threads}", "rollout.fixed_staleness=0", "rollout.max_head_offpolicyness=1",
                "rollout.backend=hf:d1", "actor.backend=torch:d1", *extra)


def test_oversubscribing_workers_wait_passively_and_the_run_says_so():
    from stalerl.config.placement import passive_wait_for_workers

    env: dict[str, str] = {}
    line = passive_wait_for_workers(_async_d1_d1(2), cpus=2, environ=env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    # a placement line (the filters that leave out "stalerl: placement:" lines leave this out too)
    assert line.startswith("stalerl: placement: OMP_WAIT_POLICY=PASSIVE for the worker processes (4 threads on 2 CPUs)")


def test_the_wait_policy_is_left_alone_where_it_does_not_apply():
    from stalerl.config.placement import passive_wait_for_workers

    cases = {
        "fits": (_async_d1_d1(1), 2, {}),
        "the user's choice": (_async_d1_d1(2), 2, {"OMP_WAIT_POLICY": "ACTIVE"}),
        "synchronous: one process, its OpenMP loaded": (_cfg("torch_threads=4", "rollout.fixed_staleness=4"), 2, {}),
        "Ray actors: the cluster's environment": (_async_d1_d1(2, "scheduler.type=ray"), 2, {}),
    }
    for why, (cfg, cpus, env) in cases.items():
        before = dict(env)
        assert passive_wait_for_workers(cfg, cpus=cpus, environ=env) is None, why
        assert env == before, why
