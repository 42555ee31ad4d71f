"""Pieces of the synchronous trainer: behaviour log-prob modes, the stale FIFO, total steps, clear errors."""

import pytest
import torch

from conftest import CPU_CONFIG, small_overrides
from stalerl.config import load_config
from stalerl.rollout.batch import RolloutBatch
from stalerl.training.staleness import StaleFIFO, staleness_stats
from stalerl.training.trainer import Trainer


def _trainer(tmp_path, **extra):
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, **extra)])
    return Trainer(cfg, log=lambda *_: None)


@pytest.mark.parametrize("mode", ["rollout", "recompute"])
def test_behaviour_logp_modes(tmp_path, mode):
    t = _trainer(tmp_path, **{"actor.behavior_logp": mode})
    t._gen_seconds, t._gen_tokens = 0.0, 0
    batch = t.generate_batch()
    recomputed = t.actor.compute_logp(batch)
    m = batch.response_mask
    if mode == "recompute":
        assert torch.equal(batch.behavior_logp[m], recomputed[m])  # the training engine's own numbers
    else:
        assert (batch.behavior_logp - recomputed)[m].abs().max() < 1e-4  # the sampler's, equal within fp tolerance


def test_generation_is_seeded_by_task_ids(tmp_path):
    a, b = _trainer(tmp_path), _trainer(tmp_path)
    for t in (a, b):
        t._gen_seconds, t._gen_tokens = 0.0, 0
    torch.manual_seed(999)  # the global RNG state must not matter
    x = a.generate_batch()
    y = b.generate_batch()
    assert torch.equal(x.response_ids, y.response_ids)
    assert a.tasks_generated == 8


def _fake_batch(version):
    n, r = 2, 3
    return RolloutBatch(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
                        response_ids=torch.zeros(n, r, dtype=torch.long), response_mask=torch.ones(n, r, dtype=torch.bool),
                        behavior_logp=torch.zeros(n, r), versions=torch.full((n, r), version), rewards=torch.zeros(n),
                        group_ids=torch.arange(n))


def test_stale_fifo_ramps_then_holds_and_round_trips():
    fifo = StaleFIFO(3)
    version = 0
    lags = []
    for step in range(8):
        batch = fifo.next_batch(lambda: _fake_batch(version))
        lags.append(staleness_stats(batch, step)["staleness/max"])
        version += 1  # one optimizer step
        if step == 4:
            state = fifo.state_dict()
            fifo = StaleFIFO(3)
            fifo.load_state_dict(state)
    assert lags == [0, 1, 2, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="fixed_staleness"):
        StaleFIFO(2).load_state_dict(state)


def test_vllm_backend_without_vllm_is_a_clear_error_before_any_work(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here; the engine itself is tested in tests/rollout_vllm")
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path), "rollout.backend=vllm:d1"])
    with pytest.raises(ImportError, match=r"rollout.backend=vllm needs vLLM: run scripts/setup_vllm.sh"):
        Trainer(cfg)
    assert not (tmp_path / "runs").exists()  # refused before the run directory, data or model
