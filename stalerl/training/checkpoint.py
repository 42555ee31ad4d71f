"""Crash-safe training checkpoints.

Layout under ``<run_dir>/checkpoints/``::

    step_<N>/state.pt      torch.save of the whole state dict (model, optimizer, RNG, counters, data position, ...)
    step_<N>/meta.json     {"step", "time", "torch_version", "sha256" of state.pt, ...}
    latest                 text file holding the directory name of the newest *committed* checkpoint

Commit protocol (each step survives SIGKILL at any instant):

1. everything is written into ``step_<N>.tmp-<pid>/`` and every file plus the directory is fsync-ed;
2. the directory is renamed to ``step_<N>`` (one atomic rename; the parent directory is fsync-ed);
3. ``latest`` is replaced atomically -- this is the commit point;
4. only then are old checkpoints beyond ``keep_last`` deleted (renamed to ``*.del-<pid>`` first, then removed).

So at any moment ``latest`` names a complete checkpoint, and the previous one is still on disk. The loader does not
trust the pointer blindly: it verifies the sha256 recorded in ``meta.json`` and falls back to the newest valid older
checkpoint if the latest one is damaged (e.g. bit rot, a disk that lied about fsync, a manual edit).

Only one process (rank 0) should call :func:`save_checkpoint` for a given run directory. :func:`load_latest_checkpoint`
never modifies anything, so every rank may call it concurrently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalerl.core.errors import UserError, resource_error
from stalerl.core.io import PathLike, atomic_write_text, fsync_dir, pid_alive

__all__ = [
    "CheckpointError",
    "CheckpointsUnusable",
    "capture_rng_state",
    "checkpoint_root",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_DIRNAME = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
FORMAT_VERSION = 1

# step_<N>                  a committed (or at least complete) checkpoint
# step_<N>.old-<pid>        the previous copy of step N, moved aside while the same step is being re-saved
# step_<N>.tmp-<pid>        being written (or left behind by a writer that died) -- never loaded
# step_<N>.del-<pid>        being deleted (or left behind by a deleter that died) -- never loaded
_FINAL_RE = re.compile(r"^step_(\d+)$")
_ASIDE_RE = re.compile(r"^step_(\d+)\.old-(\d+)$")
_LEFTOVER_RE = re.compile(r"^step_(\d+)\.(?:tmp|del)-(\d+)$")
_HASH_CHUNK = 1 << 20
# Test hook: seconds to pause with the checkpoint written but not yet renamed into place, so a test can land a real
# signal inside a save (tests/e2e/test_faults.py). Unset (always, outside those tests): no pause.
PAUSE_ENV = "STALERL_TEST_CHECKPOINT_PAUSE_S"


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or its contents do not match its recorded hash."""


@dataclass(frozen=True)
class _Entry:
    step: int
    path: Path
    aside: bool  # True for a step_<N>.old-<pid> copy (preferred less than the final name of the same step)


def checkpoint_root(run_dir: PathLike) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / CHECKPOINT_DIRNAME


# ----------------------------------------------------------------------------------------------------------- save


def save_checkpoint(run_dir: PathLike, step: int, state: dict[str, Any], *, keep_last: int = 2,
                    meta_extra: dict[str, Any] | None = None) -> Path:
    """Write ``state`` as checkpoint ``step`` under ``<run_dir>/checkpoints/step_<step>/`` and commit it.

    ``state`` is any picklable dict (tensors, state_dicts, RNG states from :func:`capture_rng_state`, counters, a
    deque of pending batches, ...); it is stored with ``torch.save``. After the new checkpoint is committed, only the
    ``keep_last`` newest checkpoints are kept. Checkpoints with a step greater than ``step`` (left over from a
    timeline that was abandoned by resuming from an earlier checkpoint) and complete-but-uncommitted ones newer than
    the previous ``latest`` are deleted too, so the kept window always belongs to the current run's history -- the
    same rule :class:`stalerl.results.metrics_log.MetricsLogger` applies to the metrics file on resume.

    ``meta_extra`` (JSON-serialisable) is added to ``meta.json``: the trainer records the run's config and step plan
    there, so the next run can be checked against them without loading ``state.pt`` (see :mod:`stalerl.training.trial_dir`).

    Returns the final checkpoint directory.
    """
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    previous_step = _read_latest_step(root)

    pid = os.getpid()
    name = f"step_{step}"
    final = root / name
    tmp = root / f"{name}.tmp-{pid}"
    if tmp.exists():  # our own leftover from an earlier failed attempt in this process
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        state_path = tmp / STATE_FILE
        with open(state_path, "wb") as raw:
            fh = _WriteErrorRecorder(raw)
            try:
                torch.save(state, fh)
                fh.flush()
                os.fsync(raw.fileno())
            except Exception as exc:
                # torch's writer turns the file's OSError into its own RuntimeError ("unexpected pos ..."): the
                # recorded OSError says what really happened (a full disk is the user's to fix, in one line).
                cause = fh.error if fh.error is not None else exc
                resource = resource_error(cause, f"checkpoint step_{step}", state_path)
                if resource is not None:
                    raise resource from exc
                raise
        # Hash what is actually on disk (read back), so the loader checks the bytes that were really written.
        digest, size = _sha256_file(state_path)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "time": time.time(),
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch_version": torch.__version__,
            "sha256": digest,
            "size_bytes": size,
            "pid": pid,
            **(meta_extra or {}),
        }
        with open(tmp / META_FILE, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)  # the directory entries of state.pt/meta.json must be durable before the rename
        if os.environ.get(PAUSE_ENV):
            time.sleep(float(os.environ[PAUSE_ENV]))

        aside: Path | None = None
        if final.exists():
            # Re-saving a step that is already on disk (e.g. after resuming from it). Directories cannot be renamed
            # over non-empty ones, so move the old copy aside; the loader still accepts step_<N>.old-<pid> if we are
            # killed between these two renames.
            aside = root / f"{name}.old-{pid}"
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(final, aside)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint and `latest` are untouched
        resource = None if isinstance(exc, UserError) else resource_error(exc, f"checkpoint step_{step}", tmp)
        if resource is not None:
            raise resource from exc
        raise

    atomic_write_text(root / LATEST_FILE, name + "\n")  # the commit point: written last

    _prune(root, step, previous_step, keep_last)
    return final


class _WriteErrorRecorder:
    """A binary file wrapper that remembers the first ``OSError`` a write raised (then re-raises it)."""

    def __init__(self, fh):
        self._fh = fh
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise

    def __getattr__(self, name: str):  # flush, tell, seek, fileno, ...
        return getattr(self._fh, name)


def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers are, by construction, from attempts that already ended
    return pid_alive(pid)


def _remove_leftovers(root: Path) -> None:
    """Delete ``*.tmp-<pid>`` / ``*.del-<pid>`` directories whose writer is gone (killed mid-save or mid-prune).

    Directories of a still-running pid are left alone: they may belong to a concurrent writer (which should not
    exist, but deleting its half-written files would turn a user error into data loss).
    """
    for child in root.iterdir():
        m = _LEFTOVER_RE.match(child.name)
        if m is None or not child.is_dir():
            continue
        if _pid_alive(int(m.group(2))):
            continue
        logger.info("removing leftover checkpoint directory %s", child)
        shutil.rmtree(child, ignore_errors=True)


def _delete_dir(path: Path) -> None:
    # Rename first (atomic) so a half-deleted directory never looks like a checkpoint; then delete at leisure.
    m = _FINAL_RE.match(path.name) or _ASIDE_RE.match(path.name)
    step = m.group(1) if m else "x"
    trash = path.with_name(f"step_{step}.del-{os.getpid()}")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def _prune(root: Path, step: int, previous_step: int | None, keep_last: int) -> None:
    entries = _scan(root)
    doomed: list[Path] = []
    survivors: dict[int, _Entry] = {}
    for e in entries:
        abandoned = e.step > step  # from a timeline we rewound past
        uncommitted = previous_step is not None and previous_step < e.step < step  # renamed but never in `latest`
        if abandoned or uncommitted:
            doomed.append(e.path)
        elif e.step in survivors:  # _scan lists the final name before .old copies of the same step
            doomed.append(e.path)
        else:
            survivors[e.step] = e
    kept_steps = sorted(survivors, reverse=True)[:keep_last]
    doomed += [e.path for s, e in survivors.items() if s not in kept_steps]
    for path in doomed:
        logger.debug("pruning checkpoint %s", path)
        _delete_dir(path)
    promoted = False
    for s in kept_steps:
        e = survivors[s]
        if e.aside:  # a moved-aside copy whose replacement never arrived: give it its proper name back
            os.replace(e.path, root / f"step_{s}")
            promoted = True
    if doomed or promoted:
        fsync_dir(root)


# ----------------------------------------------------------------------------------------------------------- load


def _scan(root: Path) -> list[_Entry]:
    """Complete-looking checkpoint directories, newest step first; for equal steps the final name comes first."""
    if not root.is_dir():
        return []
    entries = []
    for child in root.iterdir():
        m = _FINAL_RE.match(child.name)
        aside = False
        if m is None:
            m = _ASIDE_RE.match(child.name)
            aside = True
        if m is None or not child.is_dir():
            continue
        entries.append(_Entry(int(m.group(1)), child, aside))
    entries.sort(key=lambda e: (-e.step, e.aside, e.path.name))
    return entries


def _read_latest_name(root: Path) -> str | None:
    try:
        name = (root / LATEST_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("unreadable checkpoint pointer %s: %s", root / LATEST_FILE, exc)
        return None
    if not _FINAL_RE.match(name):
        logger.warning("ignoring malformed checkpoint pointer %s: %r", root / LATEST_FILE, name)
        return None
    return name


def _read_latest_step(root: Path) -> int | None:
    name = _read_latest_name(root)
    return None if name is None else int(name.split("_", 1)[1])


def list_checkpoints(run_dir: PathLike) -> list[tuple[int, Path]]:
    """``(step, directory)`` of complete-looking checkpoints (``state.pt`` and ``meta.json`` present), oldest first.

    Hashes are not verified here (that reads every byte); :func:`load_checkpoint` does that. Temp / being-deleted
    directories are never listed; a moved-aside ``.old`` copy is listed only if its step has no final directory.
    """
    out: dict[int, Path] = {}
    for e in _scan(checkpoint_root(run_dir)):
        if e.step not in out and (e.path / STATE_FILE).is_file() and (e.path / META_FILE).is_file():
            out[e.step] = e.path
    return sorted(out.items())


def load_checkpoint(ckpt_dir: PathLike, *, map_location: Any = "cpu", verify: bool = True) -> tuple[int, dict]:
    """Load one checkpoint directory; raises :class:`CheckpointError` if it is incomplete or fails its sha256 check.

    ``torch.load(weights_only=False)`` is used on purpose: the state holds arbitrary Python objects (RNG tuples,
    deques of batches, counters) that the weights-only unpickler rejects. That unpickler exists to protect against
    malicious files; these are files this library wrote itself into the run directory, so full unpickling is the
    intended trust model. Do not point this at checkpoints from untrusted sources.

    ``map_location`` defaults to ``"cpu"`` so that a checkpoint written on a GPU machine loads anywhere;
    ``load_state_dict`` moves values onto the parameters' devices anyway.
    """
    path = Path(ckpt_dir)
    meta_path, state_path = path / META_FILE, path / STATE_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        step = int(meta["step"])
        expected = str(meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: missing or unreadable {META_FILE}: {exc}") from exc
    if not state_path.is_file():
        raise CheckpointError(f"{path}: missing {STATE_FILE}")
    if verify:
        actual, _ = _sha256_file(state_path)
        if actual != expected:
            raise CheckpointError(f"{path}: sha256 mismatch for {STATE_FILE} (expected {expected}, got {actual})")
    try:
        state = torch.load(state_path, map_location=map_location, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not loadable"
        raise CheckpointError(f"{path}: torch.load failed: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: {STATE_FILE} holds {type(state).__name__}, expected dict")
    return step, state


class CheckpointsUnusable(UserError):
    """Checkpoints exist but none can be loaded: the run refuses to start over silently (and keeps them)."""


CORRUPT_SUFFIX = ".corrupt"  # step_<N>.corrupt-<time>: an unusable checkpoint set aside; never loaded, never pruned


def load_latest_checkpoint(run_dir: PathLike, *, map_location: Any = "cpu", refuse_all_invalid: bool = False,
                           set_aside_invalid: bool = False) -> tuple[int, dict] | None:
    """``(step, state)`` of the newest valid committed checkpoint, or ``None`` if there is none.

    The ``latest`` pointer is tried first. If it is damaged (fails the sha256 check, is missing files, ...), older
    checkpoints are tried newest first and a warning is logged. Directories newer than the pointer were never
    committed (the writer died between renaming them and updating the pointer) and are ignored. Without a pointer
    (killed before the first commit finished, or the file was removed), the newest valid checkpoint is used.
    Read-only by default: safe to call from every rank at once.

    ``refuse_all_invalid``: when checkpoints exist but none is valid, raise :class:`CheckpointsUnusable` (naming
    each and why) instead of returning None, so a run does not silently start over. ``set_aside_invalid`` (the one
    process that writes checkpoints): the invalid ones newer than the checkpoint loaded are renamed
    ``step_<N>.corrupt-<time>``, which no pruning ever deletes (the evidence of what happened stays).
    """
    root = checkpoint_root(run_dir)
    entries = _scan(root)
    latest_name = _read_latest_name(root)
    if latest_name is not None:
        latest_step = int(latest_name.split("_", 1)[1])
        entries = [e for e in entries if e.step <= latest_step]
    else:
        latest_step = None
        if entries:
            logger.warning("no valid '%s' pointer in %s; using the newest valid checkpoint found", LATEST_FILE, root)
    failures: list[str] = []
    reasons: list[str] = []
    invalid: list[Path] = []
    warnings: list[tuple[str, tuple]] = []  # logged unless the caller gets them all in one refusal instead
    for e in entries:
        try:
            step, state = load_checkpoint(e.path, map_location=map_location)
        except CheckpointError as exc:
            warnings.append(("skipping invalid checkpoint: %s", (exc,)))
            failures.append(e.path.name)
            reasons.append(f"{e.path.name}: {str(exc).split(': ', 1)[-1][:160]}")
            invalid.append(e.path)
            continue
        if step != e.step:
            warnings.append(("skipping checkpoint %s: meta.json says step %d", (e.path, step)))
            failures.append(e.path.name)
            reasons.append(f"{e.path.name}: meta.json says step {step}")
            invalid.append(e.path)
            continue
        for msg, args in warnings:
            logger.warning(msg, *args)
        if set_aside_invalid and invalid:
            _set_aside_invalid(root, invalid)
        if latest_step is not None and (failures or e.path.name != latest_name):
            logger.warning(
                "latest checkpoint %s is not usable (%s); falling back to %s",
                latest_name,
                ", ".join(failures) if failures else "missing",
                e.path.name,
            )
        return step, state
    if refuse_all_invalid and reasons:
        raise CheckpointsUnusable(
            f"every checkpoint of {Path(run_dir)} is unusable ({'; '.join(reasons)}); they are kept as they are. "
            "To start this trial over use recover.mode=disabled (its checkpoints are set aside, not deleted), or use "
            "a new trial_name")
    for msg, args in warnings:
        logger.warning(msg, *args)
    if latest_name is not None:
        logger.warning("checkpoint pointer names %s but no valid checkpoint was found in %s", latest_name, root)
    return None


def _set_aside_invalid(root: Path, paths: list[Path]) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in paths:
        aside = path.with_name(f"{path.name}{CORRUPT_SUFFIX}-{stamp}")
        try:
            os.replace(path, aside)
        except OSError as exc:  # pragma: no cover - a read-only directory: leave it, the loader skips it again
            logger.warning("could not set aside invalid checkpoint %s: %s", path, exc)
            continue
        logger.warning("invalid checkpoint %s set aside as %s (kept, never pruned)", path.name, aside.name)
    fsync_dir(root)


# ------------------------------------------------------------------------------------------------------------ RNG


def capture_rng_state() -> dict[str, Any]:
    """RNG states of Python ``random``, numpy's global RNG, torch CPU and (if available) every CUDA device."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency, but the RNG layer need not insist
        pass
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`. Missing entries are skipped, so older/partial dicts still work."""
    if "python" in state:
        random.setstate(_as_python_state(state["python"]))
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    cuda_states = state.get("torch_cuda")
    if cuda_states is not None:
        if not torch.cuda.is_available():
            logger.warning("checkpoint has CUDA RNG states but CUDA is not available; not restoring them")
        elif len(cuda_states) != torch.cuda.device_count():
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d; restoring the common prefix",
                len(cuda_states),
                torch.cuda.device_count(),
            )
            for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.cpu(), device=i)
        else:
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


def _as_python_state(s: Any) -> tuple:
    # random.setstate needs tuples; a state that went through JSON or another serializer may come back as lists.
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
