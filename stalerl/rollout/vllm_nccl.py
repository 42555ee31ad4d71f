"""Weight sync over NCCL for vLLM rollout workers on their own GPUs (asynchronous runs, ``weight_sync: nccl``).

The inference side is vLLM's public weight-transfer API: the worker's engine starts with
``WeightTransferConfig(backend="nccl")``, joins the trainer's group once with ``init_weight_transfer_engine``
(:func:`worker_init_info`: rank offset 1, the trainer is rank 0, ``packed=False``: unpacked is a wire parameter
of the init info in vLLM 0.32) and installs each version with ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, whose update info (:func:`update_info_for`: names, dtype names, shapes) says what the
trainer broadcasts, in that order, one NCCL broadcast per tensor from rank 0. Both dicts are checked against vLLM's
own parsing (``NCCLWeightTransferInitInfo`` / ``NCCLWeightTransferUpdateInfo``) in tests/rollout_vllm/test_vllm_api.py.

The trainer side (the controller, train rank 0) is :class:`NCCLWeightSender`: vLLM's own group primitives
(``StatelessProcessGroup`` + ``PyNcclCommunicator``, what vLLM's NCCL engine builds its group from) and one broadcast
per tensor, so it is exactly the receiving side's unpacked loop. It does not use vLLM's trainer-side engine, which
calls the inference client itself: across processes the worker's receive command must be queued in order with its
``generate`` commands (a task never runs on weights older than its admission version), so the controller queues
that command itself and only the broadcast runs here.

The broadcast blocks until the worker reaches the command (it serves one between two generations), so it runs on a
sender thread per worker, from a snapshot of the version's parameters on the controller's GPU in the engine's dtype
(:func:`snapshot_parameters`: a device-to-device copy; no host copy, no shared memory), on its own CUDA stream.
Versions are broadcast in the order they were submitted (the order the worker receives them).

Everything but the group itself is plain Python and tested on CPU with a fake communicator
(tests/unit/test_vllm_nccl.py); the GPU check exercises the group where two GPUs and vLLM are present.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

TRAINER_RANK = 0
WORKER_RANK_OFFSET = 1  # the workers' ranks follow the single trainer rank


def worker_init_info(master_address: str, master_port: int, tensor_parallel_size: int) -> dict[str, Any]:
    """The ``init_info`` of vLLM's ``init_weight_transfer_engine`` for one engine of ``tensor_parallel_size``
    workers joining the trainer's group: the trainer is rank 0, the engine's workers ranks 1..tp."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port must be a TCP port (1..65535), got {master_port}")
    # vLLM 0.32 reads `packed` from the init info (vllm/distributed/weight_transfer/nccl_common.py:101,
    # NCCLWeightTransferInitInfo; nccl_engine.py:152 stores it for every later receive): False is its default, said
    # here so the worker's loop is the one-tensor-per-broadcast loop NCCLWeightSender feeds.
    return {"master_address": str(master_address), "master_port": int(master_port),
            "rank_offset": WORKER_RANK_OFFSET, "world_size": WORKER_RANK_OFFSET + int(tensor_parallel_size),
            "packed": False}


def update_info_for(params: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The ``update_info`` of vLLM's ``update_weights`` for broadcasting ``params`` in order, unpacked (the
    receiver allocates each tensor from its name / dtype / shape and receives it with one broadcast).

    Exactly the fields of vLLM 0.32's NCCLWeightTransferUpdateInfo (vllm/distributed/weight_transfer/
    nccl_engine.py:93-95): its parse_update_info (base.py:441) refuses any other key, so ``packed`` is not here (it
    moved to the init info, :func:`worker_init_info`). 0.33 and 0.34 accept the same dict (their new fields have
    defaults; tests/unit/test_vllm_api_sources.py)."""
    return {"names": [name for name, _ in params],
            "dtype_names": [str(t.dtype).replace("torch.", "") for _, t in params],
            "shapes": [list(t.shape) for _, t in params]}


def snapshot_parameters(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters (``named_parameters``: a tied weight once, under its first name, as vLLM's
    ``ModuleSource`` gives them), copied on their device in ``dtype`` (None: as they are). A new tensor per version,
    so training may go on while a sender thread broadcasts it; the copy is complete before this returns."""
    with torch.no_grad():
        out = [(name, p.detach().to(dtype=dtype or p.dtype, copy=True).contiguous())
               for name, p in model.named_parameters()]
    if out and out[0][1].is_cuda:
        torch.cuda.current_stream(out[0][1].device).synchronize()  # the sender's stream reads these
    return out


def _vllm_group(master_address: str, master_port: int, world_size: int, device: torch.device):
    """Rank 0 of a vLLM weight-transfer group (blocks until every worker rank has joined).

    vLLM's own trainer-side helper (vllm/distributed/weight_transfer/nccl_common.py:139), the one its workers join
    with (nccl_common.py:215) and its NCCLTrainerWeightTransferEngine opens rank 0 with: StatelessProcessGroup +
    PyNcclCommunicator created under ``unpinned_nccl_env`` (the NCCL settings vLLM pins for its own communicators
    are lifted for this shared one, on both sides)."""
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    return stateless_init_process_group(master_address, master_port, TRAINER_RANK, world_size, device)


class NCCLWeightSender:
    """Trainer rank 0 of one rollout worker's weight-transfer group, broadcasting submitted versions in order on a
    thread of its own. ``make_group``: the communicator factory (vLLM's; a fake in tests), called by
    :meth:`connect` while the worker runs ``init_weight_transfer_engine``."""

    def __init__(self, init_info: dict[str, Any], device: torch.device,
                 make_group: Callable[..., Any] = _vllm_group,
                 on_error: Optional[Callable[[BaseException], None]] = None):
        self.init_info = init_info
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the communicator and the stream need the index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.make_group = make_group
        self.on_error = on_error
        self.group = None
        self.sent: list[tuple[int, float]] = []  # (version, seconds of its broadcast), in order
        self.error: Optional[BaseException] = None
        self._queue: "queue.Queue[Optional[tuple[int, list]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def connect(self) -> None:
        """Join the group as rank 0 (blocking until the worker's ranks join), then start the sender thread."""
        info = self.init_info
        self.group = self.make_group(info["master_address"], info["master_port"], info["world_size"], self.device)
        self._thread = threading.Thread(target=self._run, name="nccl-weight-sender", daemon=True)
        self._thread.start()

    def submit(self, version: int, params: list[tuple[str, torch.Tensor]]) -> None:
        """Queue ``params`` (a :func:`snapshot_parameters`) for broadcast after every version submitted before."""
        if self._thread is None:
            raise RuntimeError("NCCLWeightSender.submit before connect")
        if self.error is not None:
            raise RuntimeError(f"the NCCL weight sender failed earlier: {self.error!r}") from self.error
        self._queue.put((int(version), params))

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        while True:
            item = self._queue.get()
            if item is None:
                return
            version, params = item
            start = time.perf_counter()
            try:
                for _, tensor in params:  # the order of update_info_for(params), the receiver's order
                    self.group.broadcast(tensor, src=TRAINER_RANK, stream=stream)
                if stream is not None:
                    stream.synchronize()
            except BaseException as exc:  # noqa: BLE001 - reported to the controller, which fails the run
                self.error = exc
                if self.on_error is not None:
                    self.on_error(exc)
                return
            self.sent.append((version, time.perf_counter() - start))
            del params, item  # this version's snapshot is freed once broadcast

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        self.group = None
