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
    batch = t.source.generate_batch()
    recomputed = t.actor.compute_logp(batch)
    m = batch.response_mask
    if mode == "recompute":
        assert torch.equal(batch.behavior_logp[m], recomputed[m])  # the training engine's own numbers
    else:
        assert (batch.behavior_logp - recomputed)[m].abs().max() < 1e-4  # the sampler's, equal within fp tolerance


def test_generation_is_seeded_by_task_ids(tmp_path):
    a, b = _trainer(tmp_path), _trainer(tmp_path)
    torch.manual_seed(999)  # the global RNG state must not matter
    x = a.source.generate_batch()
    y = b.source.generate_batch()
    assert torch.equal(x.response_ids, y.response_ids)
    assert a.source.tasks_generated == 8


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


def test_the_launcher_picks_a_rollout_source_for_the_one_loop(tmp_path):
    """One Trainer class; the launcher chooses where its batches come from. Trainer(cfg) alone is the synchronous
    fixed-staleness source (the study's warm start builds it that way)."""
    from stalerl.launch.launcher import build_trainer
    from stalerl.training.async_source import AdmissionSource
    from stalerl.training.sources import FixedStalenessSource

    sync = _trainer(tmp_path, **{"rollout.fixed_staleness": 2})
    assert type(sync.source) is FixedStalenessSource and sync.source.fifo.staleness == 2
    assert type(build_trainer(sync.cfg).source) is FixedStalenessSource
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, **{
        "rollout.fixed_staleness": 0, "rollout.max_head_offpolicyness": 2})])
    trainer = build_trainer(cfg)  # no worker starts before train()
    assert type(trainer) is Trainer and type(trainer.source) is AdmissionSource
    assert trainer.source.manager.max_head_offpolicyness == 2 and not trainer.source.rollout_workers
    assert type(trainer.engine).__name__ == "HFRolloutEngine"  # the controller's: warm start checks only
