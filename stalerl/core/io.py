"""Crash-safe file writes: atomic replace of whole files and durable appends to JSON-lines logs.

Every whole-file write goes to a temporary file in the *same directory* (so ``os.replace`` is a rename within one
file system, which POSIX makes atomic), is flushed and ``fsync``-ed, then renamed over the target, and finally the
directory is ``fsync``-ed so the rename itself survives a power loss. A process killed at any instant therefore
leaves either the complete old file or the complete new one, never a mix.

torch and numpy are imported lazily (only :func:`atomic_torch_save` needs torch) so that light tools such as
``stalerl-plot`` can use this module without paying for a torch import.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import IO, Any, Callable, Mapping

from stalerl.core.errors import resource_error

__all__ = [
    "atomic_write_text",
    "atomic_write_bytes",
    "atomic_torch_save",
    "append_jsonl",
    "fsync_dir",
    "to_jsonable",
]

PathLike = str | os.PathLike


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (owned by anyone): the owner of a leftover temporary
    file or directory whose name carries its pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError as exc:  # pragma: no cover - exotic platforms
        import errno

        return exc.errno != errno.ESRCH
    return True


def _current_umask() -> int:
    # os.umask can only be read by setting it; do it once at import, before any threads of ours exist.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp creates files with mode 0600; the files we publish should get the usual umask-derived mode instead.
_FILE_MODE = 0o666 & ~_current_umask()


def fsync_dir(path: PathLike) -> None:
    """``fsync`` a directory so that renames/creations inside it are durable. No-op where unsupported (Windows)."""
    if os.name == "nt":  # directories cannot be opened for fsync on Windows; rename durability is the FS's job there
        return
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Run ``write`` on a temp file next to ``path``, make it durable, then atomically rename it to ``path``."""
    target = Path(path)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    # Hidden, uniquely named temp file in the same directory: same file system => os.replace is atomic.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())  # data must be on disk before the rename can make it visible
        os.chmod(tmp_name, _FILE_MODE)
        os.replace(tmp_name, target)
    except BaseException as exc:
        # Any failure (including KeyboardInterrupt) before the rename leaves the old file untouched; drop the temp.
        with suppress(OSError):
            os.unlink(tmp_name)
        resource = resource_error(exc, target.name, target)  # disk full / read-only: a user error, one line
        if resource is not None:
            raise resource from exc
        raise
    fsync_dir(parent)  # make the rename itself durable
    return target


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Atomically replace ``path`` with ``data``. Returns the path."""
    return _atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Atomically replace ``path`` with ``text``. Returns the path."""
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_torch_save(obj: Any, path: PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (temp file + fsync + rename + directory fsync)."""
    import torch  # lazy: keeps this module importable without torch's import cost

    return _atomic_write(path, lambda fh: torch.save(obj, fh))


def to_jsonable(value: Any) -> Any:
    """Convert ``value`` into plain JSON types.

    torch tensors / numpy arrays and scalars become Python numbers (0-d / single element) or nested lists; tuples
    become lists; mapping keys become strings; paths become strings. Anything else unknown falls back to ``str``
    so that a metrics line is never lost because of one odd value.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    # Only check torch/numpy types if those modules are already loaded: an object cannot be a tensor otherwise.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.dim() == 0 else value.tolist()
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
    item = getattr(value, "item", None)  # other array-likes exposing .item() (e.g. jax scalars)
    if callable(item):
        with suppress(Exception):
            return to_jsonable(item())
    return str(value)


def append_jsonl(path: PathLike, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` and make it durable (flush + fsync).

    Values are passed through :func:`to_jsonable`. Non-finite floats are written with ``allow_nan=True``, i.e. as the
    bare tokens ``NaN`` / ``Infinity`` / ``-Infinity``: not strict JSON, but Python's ``json`` (and pandas) read them
    back as floats, and a NaN loss is exactly what one wants to see in a training log rather than a silent null.

    If the file does not end with a newline (a previous writer was killed mid-line), a newline is added first so the
    torn fragment stays on its own line (readers skip it) instead of corrupting this record.

    A write that fails (a full disk writes part of the line, then fails) is undone: the file is cut back to its
    length before this call, so it never holds a partial line of ours, and a full disk or read-only file system
    raises :class:`~stalerl.core.errors.ResourceError` (one line for the user).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(to_jsonable(dict(record)), allow_nan=True, separators=(", ", ": ")) + "\n"
    # Unbuffered writes on a raw descriptor: a failed write leaves nothing queued that a later close would flush.
    fd = os.open(target, os.O_RDWR | os.O_APPEND | os.O_CREAT, _FILE_MODE)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        prefix = b""
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            prefix = b"\n"
        data = prefix + line.encode("utf-8")
        try:
            written = 0
            while written < len(data):  # O_APPEND: every write lands at the end
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except BaseException as exc:
            with suppress(OSError):  # shrinking needs no free space
                os.ftruncate(fd, size)
                os.fsync(fd)
            resource = resource_error(exc, "a metrics line", target)
            if resource is not None:
                raise resource from exc
            raise
    finally:
        os.close(fd)
