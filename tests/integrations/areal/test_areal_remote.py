"""AReaL's single-controller route: the controller names the engine class by import path, a remote worker imports
and builds it from that path, and the config (with ``actor.loss``) survives AReaL's RPC serialisation.

Driven through AReaL's own code: ``recipe.areal.PPOTrainer._create_train_engine`` (the trainer's engine choice),
``TrainController.initialize`` (which sends the path through the scheduler), and the worker's Flask
``/create_engine`` endpoint (``areal.infra.rpc.guard.engine_blueprint``), fed the payload AReaL's local scheduler
builds. Only the scheduler is a stand-in: it forwards to the endpoint in-process instead of over HTTP.
"""

from __future__ import annotations

from typing import Any

import pytest

from _areal_fixtures import model_dir  # noqa: F401 - pytest fixture


pytestmark = pytest.mark.areal


def _bare_trainer(scheduler: Any):
    """recipe.areal.PPOTrainer without its __init__ (which starts rollout servers): only the engine factory runs."""
    from recipe.areal.trainer import PPOTrainer

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.scheduler = scheduler
    return trainer


class _EnginesCreated(Exception):
    """Raised by the stand-in scheduler once the engines exist: the rest of initialize() needs real workers."""


class _InProcessScheduler:
    """The scheduler calls TrainController.initialize makes, answered in-process; ``create_engine`` posts AReaL's
    local-scheduler payload to the worker's real Flask endpoint."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.created: list[str] = []
        self.responses: list[Any] = []

    def create_workers(self, job: Any) -> list[str]:
        return [f"{job.role}/{i}" for i in range(job.replicas)]

    def get_workers(self, role: str) -> list[Any]:
        from areal.api.scheduler_api import Worker

        return [Worker(id=f"{role}/0", ip="127.0.0.1", worker_ports=["1", "2"], engine_ports=[])]

    async def set_worker_env(self, worker_id: str, env: dict) -> None:
        return None

    async def create_engine(self, worker_id: str, engine: str, engine_name: str | None = None, *args, **kwargs):
        from areal.infra.rpc.serialization import serialize_value

        self.created.append(engine)
        payload = {"engine": engine, "engine_name": engine_name or worker_id,
                   "init_args": serialize_value(list(args)), "init_kwargs": serialize_value(kwargs)}
        self.responses.append(self.client.post("/create_engine", json=payload))
        raise _EnginesCreated


@pytest.fixture
def worker_app():
    from flask import Flask

    from areal.infra.rpc.guard import engine_blueprint

    app = Flask("stalerl-areal-worker")
    app.register_blueprint(engine_blueprint.engine_bp)
    yield app.test_client(), engine_blueprint
    engine_blueprint._engines.clear()
    engine_blueprint.cleanup_engine_thread()


def test_single_controller_builds_the_exact_loss_engine_in_the_worker_from_its_import_path(worker_app, monkeypatch,
                                                                                           model_dir):
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import FinetuneSpec

    from recipe.areal.actor import ExactLossPPOActor
    from recipe.areal.config import ExactLossPPOActorConfig
    from recipe.areal.fsdp import ExactLossFSDPPPOActor
    from recipe.areal.trainer import PPOTrainer

    client, blueprint = worker_app
    monkeypatch.delenv("AREAL_SPMD_MODE", raising=False)  # single-controller mode
    scheduler = _InProcessScheduler(client)
    config = ExactLossPPOActorConfig(experiment_name="e", trial_name="t", backend="fsdp:d1p1t1", loss="m2po",
                                     path=str(model_dir),
                                     m2_threshold=0.02, use_decoupled_loss=True, recompute_logprob=True)
    trainer = _bare_trainer(scheduler)
    controller = PPOTrainer._create_train_engine(trainer, config, ModelAllocation.from_str(config.backend))
    assert controller.train_engine is ExactLossFSDPPPOActor

    with pytest.raises(Exception) as raised:
        controller.initialize(role="actor", ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=8,
                                                                  train_batch_size=8))
    assert "_EnginesCreated" in repr(raised.value) or isinstance(raised.value, _EnginesCreated)
    assert scheduler.created == ["recipe.areal.fsdp.ExactLossFSDPPPOActor"]
    response = scheduler.responses[0]
    assert response.status_code == 200, response.get_json()
    engine = blueprint._engines["actor/0"]
    assert type(engine) is ExactLossFSDPPPOActor and type(engine.actor) is ExactLossPPOActor
    assert type(engine.config) is ExactLossPPOActorConfig
    assert engine.actor.loss_name == "m2po" and engine.config.m2_threshold == 0.02
    assert engine.actor.m2_threshold is None  # AReaL's own M2PO is off in the worker too (0.02 is Algorithm 1's tau)


def test_spmd_mode_builds_the_exact_loss_engine_here_and_leaves_the_reference_model_to_areal(monkeypatch, model_dir):
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import PPOActorConfig
    from areal.engine.fsdp_engine import FSDPPPOActor

    from recipe.areal.config import ExactLossPPOActorConfig
    from recipe.areal.fsdp import ExactLossFSDPPPOActor
    from recipe.areal.trainer import PPOTrainer

    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    built = []
    monkeypatch.setattr(FSDPPPOActor, "create_process_group", lambda self, parallel_strategy=None: built.append(self))
    trainer = _bare_trainer(None)
    alloc = ModelAllocation.from_str("fsdp:d1p1t1")
    actor = PPOTrainer._create_train_engine(trainer, ExactLossPPOActorConfig(experiment_name="e", trial_name="t",
                                                                             path=str(model_dir), loss="fipo"), alloc)
    ref = PPOTrainer._create_train_engine(trainer, PPOActorConfig(experiment_name="e", trial_name="t",
                                                                    path=str(model_dir)), alloc)
    assert type(actor) is ExactLossFSDPPPOActor and actor.actor.loss_name == "fipo"
    assert type(ref) is FSDPPPOActor
    assert built == [actor, ref]


def test_opt_out_keeps_arealss_own_engine(monkeypatch, model_dir):
    from areal.api.alloc_mode import ModelAllocation
    from areal.engine.fsdp_engine import FSDPPPOActor

    from recipe.areal.config import ExactLossPPOActorConfig
    from recipe.areal.trainer import PPOTrainer

    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    monkeypatch.setattr(FSDPPPOActor, "create_process_group", lambda self, parallel_strategy=None: None)
    config = ExactLossPPOActorConfig(experiment_name="e", trial_name="t", path=str(model_dir), m2_threshold=0.04)  # AReaL's own M2PO
    engine = PPOTrainer._create_train_engine(_bare_trainer(None), config,
                                        ModelAllocation.from_str("fsdp:d1p1t1"))
    assert type(engine) is FSDPPPOActor
