"""Checks that run after the config loads and before any model, worker, Ray task or job starts.

Each names the dotted key, what was asked and what exists, and says what to do; all problems of one kind are
reported together in one :class:`~stalerl.core.errors.UserError` (one line). Paths and the trial directory are checked
without importing torch; the device check imports it (the run is about to anyway).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from stalerl.core.errors import UserError
from stalerl.core.model_store import is_known_model

CPU_CONFIG_HINT = ("for a CPU machine use the CPU config (--config examples/math/gsm8k_m2po_cpu.yaml: the embedded "
                   "tiny model and synthetic data, no download)")
GPU_RUN_HINT = ("on a GPU machine pass a local Hugging Face model directory (or a known model: stalerl-model list) and "
                "GSM8K data: actor.path=<model dir> "
                "train_dataset.path=<gsm8k dir> valid_dataset.path=<gsm8k dir> (or set STALERL_MODEL_PATH and "
                "GSM8K_PATH)")


def _model_choices() -> str:
    from stalerl.core.model_store import KNOWN_MODELS

    names = ", ".join(sorted(KNOWN_MODELS))
    return (f"expected a local Hugging Face model directory with config.json, a known model name ({names}; "
            "`stalerl-model list` shows them, `stalerl-model fetch <name>` converts one once), or tiny:qwen2")


MODEL_CHOICES = _model_choices()


def _is_synthetic(path: str) -> bool:
    return path == "synthetic" or path.startswith("synthetic:")


def _looks_like_hub_name(path: str) -> bool:
    from stalerl.data.gsm8k import _looks_like_hub_name  # torch-free module

    return _looks_like_hub_name(path)


def path_problems(cfg: Any) -> list[str]:
    """Model, tokenizer and dataset paths that do not exist (nothing is downloaded at run time)."""
    out = []
    for key, path in (("actor.path", cfg.actor.path), ("tokenizer_path", cfg.tokenizer_path)):
        if not path or path.startswith("tiny:") or is_known_model(path):  # a known model: fetch_known_models
            continue
        local = os.path.expanduser(path)
        if not os.path.exists(local):
            out.append(f"{key}={path!r} does not exist ({MODEL_CHOICES})")
        elif key == "actor.path" and not os.path.isdir(local):
            out.append(f"{key}={path!r} is a file, not a model directory ({MODEL_CHOICES})")
        elif key == "actor.path" and not os.path.isfile(os.path.join(local, "config.json")):
            out.append(f"{key}={path!r} has no config.json (not a Hugging Face model directory)")
    for key in ("train_dataset", "valid_dataset"):
        path = getattr(cfg, key).path
        if _is_synthetic(path) or os.path.exists(os.path.expanduser(path)):
            continue
        if _looks_like_hub_name(path) and not path.startswith("/"):
            continue  # a `datasets` name: the loader checks the offline cache and says so
        out.append(f"{key}.path={path!r} does not exist (a GSM8K .jsonl/.parquet file or directory, or synthetic)")
    return out


def _wants_cuda(cfg: Any) -> bool:
    return str(cfg.actor.device).startswith("cuda")


def ray_is_this_machine(cfg: Any) -> bool:
    """True when a Ray run would start its own local cluster (no address given), i.e. the cluster is this machine."""
    return not (cfg.scheduler.ray_address or os.environ.get("RAY_ADDRESS"))


def device_problems(cfg: Any) -> list[str]:
    """``actor.device=cuda`` where the process that will hold the model has no CUDA device."""
    if not _wants_cuda(cfg):
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return [f"actor.device={cfg.actor.device!r} but this machine has no CUDA GPU (torch {torch.__version__})"]


def check_before_launch(cfg: Any, *, check_device: Optional[bool] = None) -> None:
    """Paths, then the device (where it can be checked from here). ``check_device`` defaults to: the model lives in
    this process or on this machine (local scheduler, a Ray controller, or a Ray cluster started here)."""
    from stalerl.config import is_async

    problems = path_problems(cfg) + run_root_problems(cfg)
    if check_device is None:
        kind = cfg.scheduler.type
        check_device = kind == "local" or (kind == "ray" and (is_async(cfg) or ray_is_this_machine(cfg)))
    if check_device:
        problems += device_problems(cfg)
    if not problems and cfg.cluster.share_gpu:  # the memory split, before the trial directory or any process
        from stalerl.training.share_gpu import preflight_problems

        problems += preflight_problems(cfg)
    if not problems:
        fetch_known_models(cfg)
        return
    hints = []
    if _wants_cuda(cfg) and any(p.startswith("actor.device") for p in problems):
        hints.append(CPU_CONFIG_HINT)
    if any(".path=" in p or p.startswith(("actor.path", "tokenizer_path")) for p in problems
           if not p.startswith("cluster.fileroot")):
        hints.append(GPU_RUN_HINT if _wants_cuda(cfg) else
                     "point the keys at existing paths (nothing is downloaded at run time)")
    raise UserError("this config cannot run here: " + "; ".join(problems)
                    + (". Fix: " + "; ".join(hints) if hints else ""))


def fetch_known_models(cfg: Any) -> None:
    """A known model name in actor.path / tokenizer_path (``smollm2-135m-instruct``) is fetched and converted here,
    once, before any worker starts (workers then find it cached; :mod:`stalerl.core.model_store`). The config keeps
    the name. Its errors are one-line user errors (no network and no GGUF, a bad checksum, a full disk)."""
    from stalerl.core.model_store import resolve_model_path, stderr_log

    for path in {cfg.actor.path, cfg.tokenizer_path} - {None}:
        if is_known_model(path):
            resolve_model_path(path, log=stderr_log)


def run_root_problems(cfg: Any) -> list[str]:
    """``cluster.fileroot`` (where the run directory goes) exists as a directory we can write, or can be created:
    checked by creating (and removing) a file in the deepest existing directory on the way, never by permission bits
    (root passes those, a read-only mount does not)."""
    import errno
    import tempfile
    from pathlib import Path

    from stalerl.config import run_dir

    root = cfg.cluster.fileroot
    target = Path(os.path.abspath(run_dir(cfg)))
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return [f"cluster.fileroot={root!r}: {probe} is a file, not a directory (the run directory {target} would "
                "be inside it); point cluster.fileroot at a directory"]
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".stalerl-write-check-"):
            pass
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        name = errno.errorcode.get(exc.errno or 0, "")
        return [f"cluster.fileroot={root!r}: cannot write in {probe} ({why}{', ' + name if name else ''}); point "
                "cluster.fileroot at a writable directory"]
    return []


def check_run_root(cfg: Any) -> None:
    problems = run_root_problems(cfg)
    if problems:
        raise UserError("; ".join(problems))


def check_ray_fit(asked: dict[str, float], have: dict[str, float], what: str, fix: str) -> None:
    """Refuse at once a Ray request that no node set could ever satisfy (Ray itself would wait forever)."""
    short = {k: v for k, v in asked.items() if v > 0 and v > have.get(k, 0.0)}
    if not short:
        return
    asked_s = ", ".join(f"{k} {v:g}" for k, v in asked.items() if v > 0)
    have_s = ", ".join(f"{k} {have.get(k, 0.0):g}" for k, v in asked.items() if v > 0)
    hints = [fix]
    if "GPU" in short:
        hints.append("actor.device=cpu or " + CPU_CONFIG_HINT)
    raise UserError(f"{what} cannot fit on this Ray cluster: asked {asked_s}, the cluster has {have_s}. Fix: "
                    + "; ".join(hints))
