"""stalerl's use of vLLM's public weight-transfer API, checked against the installed vLLM's own code on CPU.

The ipc and nccl paths need CUDA (and nccl two GPUs), so what runs here is everything short of moving bytes: the
names we import and call exist with the parameters we pass (inspect.signature), the configs we build pass vLLM's
own constructors, and the init / update info we send goes through vLLM's own chain: ``LLM``'s RL methods
(vllm/entrypoints/rl/offline.py) -> the GPU worker's methods (vllm/v1/worker/gpu_worker.py) -> the backend engine's
``parse_init_info`` / ``parse_update_info`` (vllm/distributed/weight_transfer/base.py). Only the engine's transport
methods (NCCL rendezvous, receive, layerwise reload) are replaced, by recorders of what vLLM hands them.

Runs in the vLLM virtual environment (skipped elsewhere, unless STALERL_REQUIRE_VLLM=1).
"""

from __future__ import annotations

import contextlib
import inspect
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
pytestmark = pytest.mark.vllm


def _tiny_tied_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def _bind(fn, *args, **kwargs) -> None:
    """Raises TypeError when ``fn`` does not take these arguments (as a call would)."""
    inspect.signature(fn).bind(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_weight_transfer_config_is_accepted_by_engine_args_and_names_a_registered_engine(backend):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.arg_utils import EngineArgs

    config = WeightTransferConfig(backend=backend)  # what VLLMRolloutEngine.start passes as weight_transfer_config
    args = EngineArgs(model="unused", weight_transfer_config=config)
    assert args.weight_transfer_config.backend == backend
    assert backend in WeightTransferEngineFactory._registry  # create_engine (factory.py) refuses any other
    assert "weight_transfer_config" in inspect.signature(EngineArgs).parameters


# ------------------------------------------------------------------------------------------------ inference side
class _Recorder:
    """Stands for the backend engine's transport methods (CUDA only): records what vLLM's worker hands them."""

    def __init__(self, engine):
        self.calls: list[tuple] = []
        engine.init_transfer_engine = lambda info: self.calls.append(("init", info))
        engine.start_weight_update = lambda: self.calls.append(("start",))
        engine.receive_weights = lambda info: self.calls.append(("receive", info))
        engine.finish_weight_update = lambda: self.calls.append(("finish",))


class _ModelRunner:
    def reset_lora_state(self):
        pass

    def get_model(self):  # 0.34's start_weight_update lends the KV cache for the model (none here: a no-op)
        return None


def _worker_with(engine_cls):
    """vLLM's GPU worker (its real weight-transfer methods) around a real ``engine_cls`` whose transport is recorded."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_worker import Worker

    engine = object.__new__(engine_cls)  # its __init__ needs a model and a device; parsing needs neither
    recorder = _Recorder(engine)
    worker = object.__new__(Worker)
    worker.weight_transfer_engine = engine
    worker.vllm_config = VllmConfig()
    worker.rank = 0
    worker.model_runner = _ModelRunner()
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    # 0.34's worker also tracks unfinished updates and a KV-cache loan per update (gpu_worker.py:251-258)
    worker._incomplete_weight_updates = set()
    worker._weight_update_kv_cache_loan = contextlib.ExitStack()
    worker._kv_cache_reclaimable = False
    engine.reset_weight_update_target = lambda: None
    return worker, recorder


class _LLMEngine:
    """LLM.llm_engine: collective_rpc runs the named worker method in this process (as the in-process engine)."""

    def __init__(self, worker):
        self.worker = worker
        self.weight_version = None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def set_weight_version(self, version):
        self.weight_version = version

    def reset_prefix_cache(self, *args):
        return True


def _llm_over(worker):
    """An object carrying vLLM's own LLM RL methods (RLOfflineMixin) over ``worker``."""
    from vllm import LLM

    llm = object.__new__(LLM)
    llm.llm_engine = _LLMEngine(worker)
    return llm


def _nccl_engine(llm):
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # only its weight methods, over the LLM above
    engine.llm, engine.weight_sync, engine.version = llm, "nccl", -1
    engine.last_sync_seconds = engine.sync_seconds_total = 0.0
    return engine


def test_nccl_init_and_update_info_pass_vllms_own_parsing_through_llm_and_worker(monkeypatch):
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

    from stalerl.rollout.vllm_nccl import snapshot_parameters, update_info_for, worker_init_info

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)  # base.py update_weights; no device here
    worker, recorder = _worker_with(NCCLWeightTransferEngine)
    engine = _nccl_engine(_llm_over(worker))
    engine.init_weight_transfer(worker_init_info("10.0.0.5", 29555, 2))
    params = snapshot_parameters(_tiny_tied_model(), torch.bfloat16)
    engine.receive_weights(update_info_for(params), 3)

    assert [c[0] for c in recorder.calls] == ["init", "start", "receive", "finish"]
    init = recorder.calls[0][1]
    assert isinstance(init, NCCLWeightTransferInitInfo)
    # the worker's rank is dp_rank * world_size + rank + rank_offset (nccl_common.py:200-201): 1..tp after rank 0
    assert (init.master_address, init.master_port, init.rank_offset, init.world_size) == ("10.0.0.5", 29555, 1, 3)
    assert init.packed is False and init.nccl_unique_id_b64 is None  # the unpacked loop; TCP rendezvous
    update = recorder.calls[2][1]
    assert isinstance(update, NCCLWeightTransferUpdateInfo)
    assert update.names == [n for n, _ in params]
    # what the receiving loop allocates (nccl_engine.py:219-223) is what the sender broadcasts, tensor by tensor
    assert [(getattr(torch, d), list(s)) for d, s in zip(update.dtype_names, update.shapes)] == \
        [(t.dtype, list(t.shape)) for _, t in params]
    assert engine.llm.llm_engine.weight_version == "3" and engine.version == 3
    assert worker._weight_update_active is False  # the session was closed


def test_vllm_refuses_a_packed_key_in_the_nccl_update_info():
    """Why update_info_for carries no ``packed`` (it was there before this check): vLLM 0.32 takes it from the init
    info only, and its update-info parser refuses unknown keys."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    engine = object.__new__(NCCLWeightTransferEngine)
    with pytest.raises(ValueError, match="packed"):
        engine.parse_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]], "packed": False})


# ------------------------------------------------------------------------------------------------ trainer side
def test_nccl_trainer_group_is_vllms_helper_called_with_our_arguments(monkeypatch):
    import vllm.distributed.weight_transfer.nccl_common as common
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    from stalerl.rollout import vllm_nccl

    seen = []
    real = common.stateless_init_process_group
    monkeypatch.setattr(common, "stateless_init_process_group",
                        lambda *a, **k: (_bind(real, *a, **k), seen.append(a), "group")[-1])
    info = vllm_nccl.worker_init_info("127.0.0.1", 29555, 1)
    assert vllm_nccl._vllm_group(info["master_address"], info["master_port"], info["world_size"],
                                 torch.device("cuda", 0)) == "group"
    assert seen == [("127.0.0.1", 29555, 0, 2, torch.device("cuda", 0))]  # the trainer is rank 0 of tp + 1
    # NCCLWeightSender._run: group.broadcast(tensor, src=0, stream=...), the receiver's call (nccl_engine.py:224)
    _bind(PyNcclCommunicator.broadcast, object(), torch.empty(1), src=0, stream=None)
    _bind(PyNcclCommunicator.__init__, object(), object(), device=torch.device("cuda", 0))


def test_ipc_trainer_engine_client_and_source_match_vllms_protocols():
    from vllm.distributed.weight_transfer.base import ModuleSource, VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    from stalerl.rollout.vllm_engine import _LLMWeightSyncClient

    init = IPCTrainerInitInfo(rank=0)  # what VLLMRolloutEngine.start passes
    assert init.backend == "ipc" and init.is_sender and init.packed is False
    assert "ipc" in WeightTransferTrainerFactory._registry
    _bind(WeightTransferTrainerFactory.trainer_init, init, client=object(), source=object())
    client = _LLMWeightSyncClient(object())
    assert isinstance(client, VLLMWeightSyncClient)  # runtime_checkable Protocol: the four methods are there
    for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
        assert list(inspect.signature(getattr(_LLMWeightSyncClient, name)).parameters) == \
            list(inspect.signature(getattr(VLLMWeightSyncClient, name)).parameters), name
    _bind(IPCTrainerWeightTransferEngine.send_weights, object())  # VLLMRolloutEngine._install: no arguments
    model = _tiny_tied_model()
    source = ModuleSource(model)
    # 0.32: metadata() and iter(source); 0.33 on: the metadata cached_property and iter_full()
    meta = source.metadata() if callable(source.metadata) else source.metadata
    pairs = source.iter_full() if hasattr(source, "iter_full") else iter(source)
    assert [m.name for m in meta] == [n for n, _ in pairs] == [n for n, _ in model.named_parameters()]


def test_ipc_init_and_update_info_pass_vllms_own_parsing_through_our_client_llm_and_worker(monkeypatch):
    """The IPC trainer engine's calls (ipc_engine.py:302 init, :459 update, :309/:314 start/finish) through
    _LLMWeightSyncClient and LLM to the worker's IPC engine parser. The handles are the shape of reduce_tensor's
    CUDA rebuild args (torch/multiprocessing/reductions.py), which need a GPU to make."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo

    from stalerl.rollout.vllm_engine import _LLMWeightSyncClient

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    worker, recorder = _worker_with(IPCWeightTransferEngine)
    client = _LLMWeightSyncClient(_llm_over(worker))
    client.init_weight_transfer_engine({"packed": False})
    client.start_weight_update()
    handles = [{"GPU-uuid": _cuda_rebuild_args()}]
    client.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]], "ipc_handles": handles,
                           "ipc_handles_pickled": None, "tensor_sizes": None})  # asdict(IPCWeightTransferUpdateInfo)
    client.finish_weight_update()
    assert [c[0] for c in recorder.calls] == ["init", "start", "receive", "finish"]
    assert recorder.calls[0][1].packed is False
    update = recorder.calls[2][1]
    assert isinstance(update, IPCWeightTransferUpdateInfo) and update.ipc_handles == handles


def _cuda_rebuild_args() -> tuple:
    """The layout of reduce_tensor's args for a CUDA tensor: classes, torch.Size, torch.dtype, bytes handles."""
    return (torch.Tensor, torch.Size([2]), (1,), 0, torch.UntypedStorage, torch.bfloat16, 0, b"\x00" * 64, 4, 0,
            False, b"ref", 0, b"event", True)


def test_ipc_handles_cross_to_the_engine_core_only_with_pickle_allowed(monkeypatch):
    """The ipc path runs vLLM's engine core in its own process, so update_weights' kwargs go through vLLM's msgpack
    encoder: the handles' classes and dtype are refused unless VLLM_ALLOW_INSECURE_SERIALIZATION=1, which
    VLLMRolloutEngine.start sets for ipc (vllm/v1/serial_utils.py)."""
    import vllm.envs as envs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    payload = {"update_info": {"names": ["w"], "ipc_handles": [{"GPU-uuid": _cuda_rebuild_args()}]}}
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    if envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
        pytest.skip("vLLM's env cache is on in this process: the variable cannot be switched here")
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        MsgpackEncoder().encode(payload)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    frames = MsgpackEncoder().encode(payload)
    back = MsgpackDecoder().decode(frames)
    args = back["update_info"]["ipc_handles"][0]["GPU-uuid"]
    sent = _cuda_rebuild_args()
    # the pickled ones (classes, dtype) come back as themselves; msgpack gives torch.Size / stride tuples back as
    # lists, which rebuild_cuda_tensor's Tensor.set_(storage, offset, size, stride) takes alike
    assert (args[0], args[4], args[5]) == (torch.Tensor, torch.UntypedStorage, torch.bfloat16)
    assert [list(a) if isinstance(a, (tuple, list)) else a for a in args] == \
        [list(a) if isinstance(a, (tuple, list)) else a for a in sent]

