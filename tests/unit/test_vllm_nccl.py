"""The nccl weight-sync path's CPU-testable parts (stalerl.rollout.vllm_nccl): the group's init info, the update
info and the broadcast order agree with what vLLM's receiving side does, the sender keeps versions in order on its
thread, the engine drives vLLM's four-phase public API, and the controller queues the receive command before it
broadcasts. The NCCL group itself needs two GPUs and vLLM (the GPU check)."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from stalerl.rollout.vllm_engine import host_copy_needed
from stalerl.rollout.vllm_nccl import NCCLWeightSender, snapshot_parameters, update_info_for, worker_init_info


def test_worker_init_info_puts_the_trainer_at_rank_0_and_the_engine_after_it():
    assert worker_init_info("10.0.0.5", 29555, 1) == {"master_address": "10.0.0.5", "master_port": 29555,
                                                      "rank_offset": 1, "world_size": 2, "packed": False}
    assert worker_init_info("h", 1234, 4)["world_size"] == 5  # tp=4: four worker ranks after the trainer
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        worker_init_info("h", 1234, 0)
    with pytest.raises(ValueError, match="master_port"):
        worker_init_info("h", 70000, 1)


def _tiny_tied_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def test_snapshot_is_a_copy_in_the_wire_dtype_with_a_tied_weight_once():
    model = _tiny_tied_model()
    snap = snapshot_parameters(model, torch.bfloat16)
    names = [n for n, _ in snap]
    assert names == [n for n, _ in model.named_parameters()] and "lm_head.weight" not in names  # tied: once
    assert all(t.dtype == torch.bfloat16 for _, t in snap)
    before = {n: t.clone() for n, t in snap}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on: the snapshot must not move
    assert all(torch.equal(before[n], t) for n, t in snap)
    assert all(t.dtype == torch.float32 for _, t in snapshot_parameters(model, None))


class _FakeGroup:
    """Stands for the PyNcclCommunicator pair: rank 0's broadcasts land in a queue the receiver reads in order."""

    def __init__(self):
        self.wire: "queue.Queue[torch.Tensor]" = queue.Queue()
        self.calls = 0

    def broadcast(self, tensor, src, stream=None):
        assert src == 0
        self.calls += 1
        self.wire.put(tensor.clone())


def _receive_like_vllm(group: _FakeGroup, update_info: dict) -> dict[str, torch.Tensor]:
    """vLLM's unpacked receive loop (NCCLWeightTransferEngine.receive_weights, packed=False): allocate each tensor
    from the update info's dtype name and shape, receive one broadcast into it, in the update info's order. Unpacked
    is set once by the init info (worker_init_info), and vLLM's update info has no other keys than these three."""
    assert set(update_info) == {"names", "dtype_names", "shapes"}
    out = {}
    for name, dtype_name, shape in zip(update_info["names"], update_info["dtype_names"], update_info["shapes"]):
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
        weight.copy_(group.wire.get(timeout=10))
        out[name] = weight
    return out


def test_update_info_and_broadcast_order_give_the_receiver_every_tensor_exactly():
    model = _tiny_tied_model()
    params = snapshot_parameters(model, torch.bfloat16)
    info = update_info_for(params)
    assert len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]) == len(params)
    made = []
    group = _FakeGroup()
    sender = NCCLWeightSender(worker_init_info("127.0.0.1", 29500, 1), torch.device("cpu"),
                              make_group=lambda *a: made.append(a) or group)
    sender.connect()
    assert made == [("127.0.0.1", 29500, 2, torch.device("cpu"))]
    sender.submit(3, params)
    got = _receive_like_vllm(group, info)
    assert list(got) == [n for n, _ in params]
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in params)
    sender.close()
    assert [v for v, _ in sender.sent] == [3]


def test_sender_broadcasts_versions_in_submission_order_on_its_thread():
    group = _FakeGroup()
    sender = NCCLWeightSender(worker_init_info("h", 1234, 1), torch.device("cpu"), make_group=lambda *a: group)
    with pytest.raises(RuntimeError, match="before connect"):
        sender.submit(0, [])
    sender.connect()
    for v in range(4):
        sender.submit(v, [("w", torch.full((2,), float(v)))])
    received = [group.wire.get(timeout=10)[0].item() for _ in range(4)]
    sender.close()
    assert received == [0.0, 1.0, 2.0, 3.0] and [v for v, _ in sender.sent] == [0, 1, 2, 3]


def test_a_failed_broadcast_is_reported_and_refuses_later_versions():
    class Broken:
        def broadcast(self, tensor, src, stream=None):
            raise RuntimeError("NCCL error: remote process exited")

    errors, done = [], threading.Event()
    sender = NCCLWeightSender(worker_init_info("h", 1234, 1), torch.device("cpu"), make_group=lambda *a: Broken(),
                              on_error=lambda e: (errors.append(e), done.set()))
    sender.connect()
    sender.submit(1, [("w", torch.zeros(1))])
    assert done.wait(10) and "remote process exited" in str(errors[0])
    with pytest.raises(RuntimeError, match="failed earlier"):
        sender.submit(2, [("w", torch.zeros(1))])
    sender.close()


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, request):
        self.calls.append(("update", request))

    def finish_weight_update(self, version=None):
        self.calls.append(("finish", version))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))


def _engine(weight_sync: str):
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # no vLLM here: the engine's weight methods over a fake LLM
    engine.llm, engine.weight_sync, engine.version = _FakeLLM(), weight_sync, -1
    engine.last_sync_seconds = engine.sync_seconds_total = 0.0
    return engine


def test_engine_drives_vllms_four_phase_api_and_stamps_the_version_after_it():
    engine = _engine("nccl")
    info = worker_init_info("h", 1234, 1)
    engine.init_weight_transfer(info)
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    engine.receive_weights(update, 5)
    assert engine.llm.calls == [("init", {"init_info": info}), ("start",), ("update", {"update_info": update}),
                                ("finish", "5"), ("reset",)]
    assert engine.version == 5
    with pytest.raises(RuntimeError, match="over NCCL"):
        engine._install({})  # a state dict never reaches an nccl engine
    other = _engine("reload")
    with pytest.raises(RuntimeError, match="reload"):
        other.receive_weights(update, 1)


class _Worker:
    role = "rollout/0"

    def __init__(self, events):
        self.events = events

    def call(self, method, *args):
        self.events.append(("call", method, *args))


class _Sender:
    def __init__(self, events):
        self.events = events

    def submit(self, version, params):
        self.events.append(("broadcast", version, [n for n, _ in params]))


def _controller(tmp_path, events, behavior_logp: str):
    from types import SimpleNamespace

    from stalerl.training.async_source import AdmissionSource

    trainer = object.__new__(AdmissionSource)  # the weight methods only, on stand-in config sections and hosting
    trainer.actor_cfg = SimpleNamespace(behavior_logp=behavior_logp, dtype="bfloat16")
    trainer.rollout = SimpleNamespace(weight_sync="shared_memory", vllm=SimpleNamespace(dtype=None))
    trainer.hosting = SimpleNamespace(share=lambda state: {"shared": sorted(state)})
    trainer.model = torch.nn.Linear(2, 3)
    trainer.nccl_senders, trainer.sent_version, trainer.loaded_version = {"rollout/0": _Sender(events)}, {}, {}
    trainer.weight_files, trainer.run_dir = {}, tmp_path
    trainer.host_copy = host_copy_needed("nccl", SimpleNamespace(actor=trainer.actor_cfg))  # as AdmissionSource.__init__ decides it
    return trainer


def test_host_copy_is_published_for_every_path_but_nccl_and_for_a_recompute_worker():
    from types import SimpleNamespace

    rollout, recompute = (SimpleNamespace(actor=SimpleNamespace(behavior_logp=b)) for b in ("rollout", "recompute"))
    assert not host_copy_needed("nccl", rollout)  # vLLM alone on nccl: no state dict, no /dev/shm check
    assert host_copy_needed("nccl", recompute)  # its HF model recomputes behaviour log-probs
    for path in (None, "reload"):  # HF rollout workers; the CPU build's vLLM
        assert host_copy_needed(path, rollout) and host_copy_needed(path, recompute)


@pytest.mark.parametrize("behavior_logp", ["rollout", "recompute"])
def test_controller_queues_the_receive_command_before_broadcasting_and_sends_each_version_once(tmp_path,
                                                                                              behavior_logp):
    """publish_weights + _send_latest_weights on the nccl path: a bf16 snapshot on the controller's device, the
    worker's receive command queued before the broadcast, each version once; the host copy only for a worker whose
    HF model recomputes behaviour log-probs."""
    events = []
    trainer = _controller(tmp_path, events, behavior_logp)
    trainer.publish_weights(4)
    version, method, (info, params, host) = trainer.latest_weights
    assert (version, method) == (4, "receive_weights") and info == update_info_for(params)
    assert info["names"] == ["weight", "bias"] and info["dtype_names"] == ["bfloat16", "bfloat16"]
    assert host == (None if behavior_logp == "rollout" else ("load_weights", {"shared": ["bias", "weight"]}))
    worker = _Worker(events)
    trainer._send_latest_weights(worker)
    trainer._send_latest_weights(worker)  # already sent: coalesced
    assert events == [("call", "receive_weights", 4, info, host), ("broadcast", 4, ["weight", "bias"])]


def test_worker_loads_the_host_copy_into_its_hf_model_before_vllm_receives(tmp_path):
    from stalerl.training.workers.rollout_worker import RolloutWorker

    order = []

    class Engine:
        def receive_weights(self, info, version):
            order.append(("vllm", version, float(worker.model.weight.detach().sum())))

    worker = object.__new__(RolloutWorker)
    worker.model, worker.engine = torch.nn.Linear(2, 1, bias=False), Engine()
    state = {"weight": torch.ones(1, 2)}
    worker.receive_weights(7, {"names": ["weight"]}, ("load_weights", state))
    torch.save({"weight": torch.full((1, 2), 3.0)}, tmp_path / "v8.pt")
    worker.receive_weights(8, {"names": ["weight"]}, ("load_weights_from_file", str(tmp_path / "v8.pt")))
    out = worker.receive_weights(9, {"names": ["weight"]})  # no host copy: the HF model is left alone
    assert order == [("vllm", 7, 2.0), ("vllm", 8, 6.0), ("vllm", 9, 6.0)] and out["version"] == 9
