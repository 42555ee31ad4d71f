"""actor.backend values the training engines cannot honour are refused at load, naming the key and the fix."""

import pytest

from stalerl.config import ConfigError, load_config


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    return str(e.value)


@pytest.mark.parametrize("backend, fix", [("fsdp:d2t2", "fsdp:d4"), ("fsdp:d1t8", "fsdp:d8"),
                                          ("fsdp:d2p2", "fsdp:d4")])
def test_tensor_and_pipeline_parallel_training_is_refused_with_the_fix(backend, fix):
    msg = _error([f"actor.backend={backend}"])
    assert "actor.backend" in msg and "tensor and pipeline parallelism are not implemented" in msg
    assert f"Fix: use {fix}" in msg


@pytest.mark.parametrize("staleness_mode", [["rollout.fixed_staleness=4"], ["rollout.mode=sync"]])
@pytest.mark.parametrize("backend", ["torch:d2", "fsdp:d2"])
def test_data_parallel_training_in_the_single_process_loop_is_refused(backend, staleness_mode):
    # Before: accepted, and the single-process loop silently trained on one rank.
    msg = _error([f"actor.backend={backend}", *staleness_mode])
    assert "actor.backend" in msg and "single-process loop" in msg and "max_head_offpolicyness" in msg


@pytest.mark.parametrize("staleness_mode", [["rollout.fixed_staleness=4"], ["rollout.mode=sync"]])
def test_several_rollout_workers_in_the_single_process_loop_are_refused(staleness_mode):
    # Before: accepted, and the single-process loop silently generated with one engine.
    msg = _error(["rollout.backend=hf:d2", *staleness_mode])
    assert "rollout.backend" in msg and "single-process loop" in msg and "rollout.backend=hf:d1" in msg


@pytest.mark.parametrize("backend", ["torch:d2", "fsdp:d2", "fsdp:d1"])
def test_data_parallel_backends_load_for_the_async_runtime(backend):
    cfg = load_config([f"actor.backend={backend}", "rollout.max_head_offpolicyness=2"])
    assert cfg.actor.backend == backend
