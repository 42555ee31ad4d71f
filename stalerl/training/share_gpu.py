"""Asynchronous dX+dY on ONE device (``cluster.share_gpu``): the plan, the memory fractions, the fit check, the
weight-sync path.

The local scheduler puts every rollout worker and train rank on the device of train rank 0 (the controller). Each
process caps its allocator at its fraction of the device (``torch.cuda.set_per_process_memory_fraction``), so one
side cannot starve the other mid-run; the fractions are given (``cluster.share_gpu_train_fraction`` /
``share_gpu_rollout_fraction``) or derived from an estimate of each side's need:

- a train process: fp32 weights + fp32 gradients + AdamW's two fp32 moments + two weight snapshots in flight for the
  rollout workers (rank 0 only; counted for every rank) + one micro-batch's activations (34 x hidden bytes per token
  and layer at a 16-bit compute dtype, twice that at float32: Korthikanti et al. 2022, without recomputation; plus one
  fp32 logits row per token);
- a rollout worker: fp32 weights + the KV cache of max_concurrent_rollouts x n_samples rows x (prompt +
  max_new_tokens) tokens at the compute dtype + one fp32 logits row per sequence;

each times SAFETY (the estimate leaves out allocator fragmentation and the attention scores). The device's usable
memory is its total less CONTEXT_BYTES per process (CUDA contexts live outside the caps). A split that cannot hold
the estimates is refused in one line (exit 2) before any worker starts.

Weights go trainer -> rollout worker by CUDA IPC (a fresh device copy per version, sent through the workers'
command queue as an IPC handle: torch.multiprocessing's CUDA tensor sharing; the rollout worker copies it into its
model between two generations, so it generates with exactly the version it reports), else through host memory
(``rollout.weight_sync``: shared memory or files). NCCL is never used between processes of one device; data-parallel
train ranks use gloo.

CPU dry mode (``actor.device=cpu``): the same plan, fractions and fit check with the host as the "device" (its
MemTotal as the stated memory figure, as a GPU's total is on CUDA: stable whatever else runs; the caps are logged, not
enforced; CONTEXT_BYTES is set aside per process there too, so the arithmetic is the GPU's) and the host weight path,
so CI runs it without a GPU.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from stalerl.config.share_gpu import MAX_FRACTION_SUM

SAFETY = 1.25
CONTEXT_BYTES = 512 * 2**20  # per process on CUDA: context, cuBLAS workspace, kernels (outside the allocator cap)
ACT_BYTES_PER_TOKEN_LAYER_HIDDEN_16BIT = 34  # Korthikanti et al. 2022 (16-bit activations, no recomputation)
DEFAULT_PROMPT_TOKENS = 512  # when train_dataset.max_length is null
FRACTION_ENV = "STALERL_SHARE_GPU_FRACTION"  # a worker process's cap, set by the controller at spawn
SYNC_ENV = "STALERL_SHARE_GPU_SYNC"  # "host" forces the host path (a test, or a platform where IPC misbehaves)
GIB = 2**30

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


@dataclass(frozen=True)
class ModelDims:
    n_params: int
    hidden: int
    layers: int
    vocab: int
    kv_dim: int  # n_kv_heads * head_dim

    @classmethod
    def of(cls, model: Any) -> "ModelDims":
        c = model.config
        hidden = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        return cls(n_params=sum(p.numel() for p in model.parameters()), hidden=hidden,
                   layers=int(c.num_hidden_layers), vocab=int(c.vocab_size), kv_dim=kv_heads * head_dim)


def compute_bytes(dtype: str) -> int:
    return _BYTES.get(str(dtype), 4)


def train_tokens_per_micro_batch(cfg: Any, n_train: int) -> int:
    """The largest micro-batch a train rank runs: its share of one mini-batch, capped by max_tokens_per_mb."""
    rows = -(-cfg.rollout.consumer_batch_size * cfg.gconfig.n_samples // (cfg.actor.ppo_n_minibatches * n_train))
    return min(int(cfg.actor.mb_spec.max_tokens_per_mb), rows * sequence_tokens(cfg))


def sequence_tokens(cfg: Any) -> int:
    prompt = cfg.train_dataset.max_length or DEFAULT_PROMPT_TOKENS
    return int(prompt) + int(cfg.gconfig.max_new_tokens)


def train_bytes(dims: ModelDims, cfg: Any, n_train: int) -> int:
    """One train process's estimate (module docstring), SAFETY included."""
    states = dims.n_params * 4 * (1 + 1 + 2 + 2)  # weights, grads, AdamW m and v, two snapshots for the workers
    tokens = train_tokens_per_micro_batch(cfg, n_train)
    acts = (tokens * dims.layers * dims.hidden * ACT_BYTES_PER_TOKEN_LAYER_HIDDEN_16BIT
            * compute_bytes(cfg.actor.dtype) // 2)
    logits = tokens * dims.vocab * 4
    return int(SAFETY * (states + acts + logits))


def rollout_rows(cfg: Any) -> int:
    return int(cfg.rollout.max_concurrent_rollouts or cfg.rollout.consumer_batch_size) * int(cfg.gconfig.n_samples)


def rollout_bytes(dims: ModelDims, cfg: Any) -> int:
    """One rollout worker's estimate (module docstring), SAFETY included."""
    rows = rollout_rows(cfg)
    kv = rows * sequence_tokens(cfg) * dims.layers * 2 * dims.kv_dim * compute_bytes(cfg.actor.dtype)
    return int(SAFETY * (dims.n_params * 4 + kv + rows * dims.vocab * 4))


def split_fractions(train_need: int, rollout_need: int, n_train: int, n_rollout: int, total: int, *,
                    train_fraction: Optional[float] = None, rollout_fraction: Optional[float] = None
                    ) -> tuple[float, float, float]:
    """(train fraction, rollout fraction, usable fraction). Given fractions are kept; a null one gets what the other
    leaves of the usable memory; both null: the usable memory split in proportion to the needs."""
    procs = n_train + n_rollout
    usable = min(MAX_FRACTION_SUM, max(0.0, 1.0 - procs * CONTEXT_BYTES / total)) if total else 0.0
    if train_fraction is not None and rollout_fraction is not None:
        return train_fraction, rollout_fraction, usable
    if train_fraction is not None:
        return train_fraction, max(0.0, (usable - n_train * train_fraction) / n_rollout), usable
    if rollout_fraction is not None:
        return max(0.0, (usable - n_rollout * rollout_fraction) / n_train), rollout_fraction, usable
    need = n_train * train_need + n_rollout * rollout_need
    return usable * train_need / need, usable * rollout_need / need, usable


def fit_problem(train_need: int, rollout_need: int, train_fraction: float, rollout_fraction: float,
                n_train: int, n_rollout: int, total: int, usable: float, what: str) -> Optional[str]:
    """One line when the split cannot hold the estimates (or the fractions exceed the usable memory), else None."""
    short = []
    if n_train * train_fraction + n_rollout * rollout_fraction > usable + 1e-9:
        short.append(f"the fractions ({n_train} x {train_fraction:.3f} + {n_rollout} x {rollout_fraction:.3f}) exceed "
                     f"the usable {usable:.3f} of {what}")
    if train_fraction * total < train_need:
        short.append(f"a train process needs ~{train_need / GIB:.2f} GiB but gets {train_fraction:.3f} x "
                     f"{total / GIB:.2f} GiB = {train_fraction * total / GIB:.2f} GiB")
    if rollout_fraction * total < rollout_need:
        short.append(f"a rollout worker needs ~{rollout_need / GIB:.2f} GiB but gets {rollout_fraction:.3f} x "
                     f"{total / GIB:.2f} GiB = {rollout_fraction * total / GIB:.2f} GiB")
    if not short:
        return None
    return ("cluster.share_gpu=true: the memory split cannot fit on " + what + ": " + "; ".join(short)
            + f" (estimates x{SAFETY} safety: train = weights + grads + AdamW + 2 snapshots + one micro-batch's "
            "activations; rollout = weights + KV cache of rollout.max_concurrent_rollouts x gconfig.n_samples rows x "
            "(prompt + gconfig.max_new_tokens)). Fix: lower actor.mb_spec.max_tokens_per_mb, "
            "rollout.max_concurrent_rollouts or gconfig.max_new_tokens, set cluster.share_gpu_train_fraction / "
            "cluster.share_gpu_rollout_fraction to null (derived), or set cluster.share_gpu=false (one GPU per "
            "process)")


# ------------------------------------------------------------------------------------------------ device memory
def host_memory_bytes() -> Optional[int]:
    """MemTotal from /proc/meminfo (the CPU dry mode's stated memory figure: the host's total, as the device's total
    is on CUDA, so the verdict does not depend on what else runs), None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cuda_total_bytes(index: int = 0) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).total_memory)


# ------------------------------------------------------------------------------------------------ weight sync
def cuda_ipc_available() -> tuple[bool, str]:
    """Whether a CUDA tensor can go to another process of this machine as an IPC handle, and why (not)."""
    if os.environ.get(SYNC_ENV, "") == "host":
        return False, f"{SYNC_ENV}=host"
    if not sys.platform.startswith("linux"):
        return False, f"CUDA IPC is not offered on {sys.platform}"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        from torch.multiprocessing.reductions import reduce_tensor  # noqa: F401 - the CUDA IPC pickler
    except ImportError as exc:
        return False, f"torch.multiprocessing.reductions is missing ({exc})"
    return True, "same device, torch.multiprocessing CUDA tensor sharing"


def choose_weight_sync(device_type: str, weight_sync: str,
                       ipc_available: Callable[[], tuple[bool, str]] = cuda_ipc_available) -> tuple[str, str]:
    """(path, why): ``cuda_ipc`` on a CUDA device where IPC is available, else the host path
    (``host_shared_memory`` or ``host_disk``, as rollout.weight_sync says)."""
    host = "host_shared_memory" if weight_sync == "shared_memory" else "host_disk"
    if device_type != "cuda":
        return host, f"CPU dry mode: the device is the host; rollout.weight_sync={weight_sync}"
    ok, why = ipc_available()
    if ok:
        return "cuda_ipc", why
    return host, f"CUDA IPC unavailable: {why}; rollout.weight_sync={weight_sync}"


def device_snapshot(model: Any) -> dict[str, Any]:
    """A fresh device copy of the weights per version (the one the workers read is never overwritten; torch keeps a
    sent CUDA block alive until every receiving process has released it)."""
    import torch

    with torch.no_grad():
        snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if any(v.is_cuda for v in snap.values()):
        # the copies are complete before any handle leaves (the queue's feeder thread pickles them later)
        torch.cuda.current_stream().synchronize()
    return snap


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class SharePlan:
    device: str  # "cuda" or "cpu" (dry mode)
    n_train: int
    n_rollout: int
    train_fraction: float
    rollout_fraction: float
    train_need: int
    rollout_need: int
    total: Optional[int]  # device (or host) bytes; None: unknown, fit check skipped
    sync: tuple[str, str]
    notes: list[str] = field(default_factory=list)

    @property
    def dry(self) -> bool:
        return self.device != "cuda"

    def roles(self) -> dict[str, float]:
        """Every process's fraction: train/0 is the controller."""
        out = {f"train/{r}": self.train_fraction for r in range(self.n_train)}
        out.update({f"rollout/{i}": self.rollout_fraction for i in range(self.n_rollout)})
        return out

    def lines(self) -> list[str]:
        where = "the one CUDA device" if not self.dry else "CPU dry mode (the host stands in for the device)"
        size = f"{self.total / GIB:.2f} GiB" if self.total else "unknown size"
        out = [f"share_gpu: {self.n_rollout} rollout + {self.n_train} train processes on {where}, {size}; "
               f"fractions: train {self.train_fraction:.3f} each (needs ~{self.train_need / GIB:.2f} GiB), rollout "
               f"{self.rollout_fraction:.3f} each (needs ~{self.rollout_need / GIB:.2f} GiB)"
               + ("" if not self.dry else "; caps logged, not enforced")]
        out += self.notes
        out.append(f"share_gpu weight sync: {self.sync[0]} ({self.sync[1]})")
        return out


def make_plan(cfg: Any, dims: ModelDims, n_train: int, n_rollout: int, device_type: str, *,
              total: Optional[int] = None, ipc_available: Callable[[], tuple[bool, str]] = cuda_ipc_available
              ) -> SharePlan:
    """The plan, or a UserError (one line) when the split cannot fit. ``total``: the device's (CUDA) or the host's
    (dry mode) memory; None reads it (CUDA: device 0's total; CPU: MemTotal)."""
    from stalerl.core.errors import ResourceError

    cl = cfg.cluster
    tneed, rneed = train_bytes(dims, cfg, n_train), rollout_bytes(dims, cfg)
    notes = []
    if total is None:
        total = cuda_total_bytes() if device_type == "cuda" else host_memory_bytes()
    if not total:
        notes.append("share_gpu: the memory size is unknown here (no /proc/meminfo): fit check skipped")
        ft = cl.share_gpu_train_fraction or MAX_FRACTION_SUM / (n_train + n_rollout)
        fr = cl.share_gpu_rollout_fraction or MAX_FRACTION_SUM / (n_train + n_rollout)
        return SharePlan(device_type, n_train, n_rollout, ft, fr, tneed, rneed, None,
                         choose_weight_sync(device_type, cfg.rollout.weight_sync, ipc_available), notes)
    ft, fr, usable = split_fractions(tneed, rneed, n_train, n_rollout, total, train_fraction=cl.share_gpu_train_fraction,
                                     rollout_fraction=cl.share_gpu_rollout_fraction)
    what = (f"the CUDA device ({total / GIB:.2f} GiB)" if device_type == "cuda"
            else f"this host (CPU dry mode: MemTotal {total / GIB:.2f} GiB)")
    problem = fit_problem(tneed, rneed, ft, fr, n_train, n_rollout, total, usable, what)
    if problem:
        raise ResourceError(problem)
    return SharePlan(device_type, n_train, n_rollout, ft, fr, tneed, rneed, total,
                     choose_weight_sync(device_type, cfg.rollout.weight_sync, ipc_available), notes)


def apply_memory_fraction(fraction: float, device_type: str, log: Callable[[str], None] = print) -> None:
    """Cap this process's allocator on the shared device (CUDA); in dry mode only say what the cap would be."""
    if device_type != "cuda":
        log(f"share_gpu: memory fraction {fraction:.3f} (CPU dry mode: not enforced)")
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device())
    log(f"share_gpu: memory fraction {fraction:.3f} of cuda:{torch.cuda.current_device()} "
        f"({fraction * cuda_total_bytes(torch.cuda.current_device()) / GIB:.2f} GiB)")


def apply_fraction_from_env(log: Callable[[str], None] = print) -> None:
    """In a worker process, before its model exists: the cap the controller chose (FRACTION_ENV = 'fraction:device')."""
    spec = os.environ.get(FRACTION_ENV)
    if not spec:
        return
    fraction, _, device_type = spec.partition(":")
    apply_memory_fraction(float(fraction), device_type or "cuda", log)


# ------------------------------------------------------------------------------------------------ before the run
def model_dims_from_config(cfg: Any) -> ModelDims:
    """The policy's dimensions without its weights: the tiny model is built on the CPU (it is small); a Hugging Face
    directory (or a known model name, already fetched by the preflight) is instantiated on the meta device."""
    import dataclasses

    import torch

    if cfg.actor.path.startswith("tiny:"):
        from stalerl.core.model import load_policy_from_config

        model, _ = load_policy_from_config(dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor,
                                                                                              device="cpu")))
        return ModelDims.of(model)
    from transformers import AutoConfig, AutoModelForCausalLM

    from stalerl.core.model_store import resolve_model_path

    config = AutoConfig.from_pretrained(os.path.expanduser(resolve_model_path(cfg.actor.path, log=lambda _: None)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return ModelDims.of(model)


def device_type_of(cfg: Any) -> str:
    import torch

    device = str(cfg.actor.device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def preflight_problems(cfg: Any) -> list[str]:
    """The fit check before the trial directory or any process exists (stalerl.launch.preflight): [] or the one-line
    refusal. The asynchronous source repeats it at start with the loaded model (the same estimate)."""
    from stalerl.config import ROLLOUT_ENGINES, TRAIN_ENGINES, parse_backend
    from stalerl.core.errors import UserError

    if not cfg.cluster.share_gpu:
        return []
    n_rollout = parse_backend(cfg.rollout.backend, engines=ROLLOUT_ENGINES).dp
    n_train = parse_backend(cfg.actor.backend, engines=TRAIN_ENGINES).dp
    try:
        make_plan(cfg, model_dims_from_config(cfg), n_train, n_rollout, device_type_of(cfg),
                  ipc_available=lambda: (True, "not chosen yet"))
    except UserError as err:
        return [str(err)]
    return []
