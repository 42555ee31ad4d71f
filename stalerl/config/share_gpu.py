"""Cross-field rules of ``cluster.share_gpu`` (asynchronous dX+dY on one device), torch-free.

:func:`share_gpu_problems` names every setting ``share_gpu`` cannot run with, as (key, message) pairs in the
config rules' form (``stalerl.config.rules._cross_field_problems`` adds them, so they are refused with the rest, one
line, exit 2, before anything starts). The memory split itself needs the model's size and is checked when the
asynchronous source starts (``stalerl.training.share_gpu``), before any worker process exists.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from stalerl.config.backend import ROLLOUT_ENGINES, TRAIN_ENGINES, is_async, parse_backend

# What the processes of one device may use together at most, as a fraction of its memory, when both fractions are
# given: the CUDA contexts and the allocators' fragmentation live outside the per-process caps.
MAX_FRACTION_SUM = 0.95


def share_gpu_problems(cfg: Any) -> List[Tuple[str, str]]:
    """Problems of ``cluster.share_gpu=true`` with the rest of ``cfg`` (an ExperimentConfig); [] when it is off."""
    if not cfg.cluster.share_gpu:
        return []
    out: List[Tuple[str, str]] = []
    ro = cfg.rollout
    rb = parse_backend(ro.backend, engines=ROLLOUT_ENGINES, key="rollout.backend")
    ab = parse_backend(cfg.actor.backend, engines=TRAIN_ENGINES, key="actor.backend")
    if not is_async(cfg):
        why = (f"rollout.fixed_staleness={ro.fixed_staleness}" if ro.fixed_staleness > 0
               else f"rollout.mode={ro.mode}" if ro.mode == "sync" else "rollout.max_head_offpolicyness=0 with d1+d1")
        out.append(("cluster.share_gpu",
                    f"got true but this run is synchronous ({why}): its one process already holds the model and "
                    "the engine on one device; share_gpu places the asynchronous runtime's separate rollout and "
                    "train processes on one device. Fix: set rollout.fixed_staleness=0 and "
                    "rollout.max_head_offpolicyness=<k> > 0 (or rollout.mode=async), or cluster.share_gpu=false."))
    if rb.engine != "hf":
        out.append(("rollout.backend",
                    f"got {ro.backend!r} with cluster.share_gpu=true; one shared device is supported for the hf "
                    "engine only (vLLM/SGLang size and own their device memory themselves). Fix: set "
                    f"rollout.backend=hf:d{rb.dp}, or cluster.share_gpu=false (one GPU per process)."))
    if ab.engine == "fsdp" and ab.dp > 1:
        out.append(("actor.backend",
                    f"got {cfg.actor.backend!r} with cluster.share_gpu=true; FSDP's collectives need NCCL, which "
                    "refuses two ranks on one device. Fix: set actor.backend=torch:d"
                    f"{ab.dp} (replicas over gloo) or torch:d1, or cluster.share_gpu=false."))
    if cfg.scheduler.type != "local":
        out.append(("scheduler.type",
                    f"got {cfg.scheduler.type!r} with cluster.share_gpu=true; sharing one device is done by the "
                    "local scheduler (the processes of one machine). Fix: set scheduler.type=local, or "
                    "cluster.share_gpu=false."))
    ft, fr = cfg.cluster.share_gpu_train_fraction, cfg.cluster.share_gpu_rollout_fraction
    if ft is not None and fr is not None:
        total = ab.dp * ft + rb.dp * fr
        if total > MAX_FRACTION_SUM + 1e-12:
            out.append(("cluster.share_gpu_train_fraction",
                        f"{ab.dp} train x {ft} + {rb.dp} rollout x {fr} = {total:.3g} of the device, more than "
                        f"{MAX_FRACTION_SUM} (the rest holds the CUDA contexts). Fix: lower "
                        "cluster.share_gpu_train_fraction / cluster.share_gpu_rollout_fraction, or set either to "
                        "null (derived)."))
    return out
