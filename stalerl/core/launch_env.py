"""Environment variables shared by the command line and the trainers, and the process-wide allocator setting
(torch-free, so the CLI stays fast)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

# When the job was launched (time.time()), for the start-up overhead metric; inherited by workers, tasks and jobs.
LAUNCH_TIME_ENV = "STALERL_LAUNCH_TIME"

# glibc malloc's mmap threshold for this process, in bytes; unset or "keep" leaves glibc's default (a threshold that
# starts at 128 KiB and climbs to the size of every mmapped block freed, up to 32 MiB on 64-bit).
MALLOC_MMAP_THRESHOLD_ENV = "STALERL_MALLOC_MMAP_THRESHOLD"
# What a fixed threshold does (bench/real_model_memory.py, SmolLM2-135M): torch's CPU tensors come from malloc. After
# the first free of a large mmapped buffer, glibc raises its threshold to that buffer's size, so every later
# activation tensor up to 32 MiB (a 64 x 56-token micro-batch's are 8-22 MiB) is carved from the heap arenas
# instead; what a backward pass frees there stays in the process as free-but-held arena memory (fragmented: the top
# of the heap is rarely free, so it cannot be trimmed). A fixed threshold turns the dynamic rule off: every buffer of
# at least this size is its own mapping and goes back to the kernel when freed (SmolLM2's peak 4.6 -> 3.6 GB with
# gradient checkpointing). The cost is a page fault per 4 KiB page of each such buffer when it is first written:
# measured 1.35-1.40x the forward/backward time (SmolLM2, 32 x 60 tokens, 2 threads, AVX2 EPYC, 2026-12-07). So it
# is an opt-in (STALERL_MALLOC_MMAP_THRESHOLD=1048576, the value measured), not the default.
DEFAULT_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
# glibc's own variable, read once when a process starts: set for the child processes (rollout and train workers,
# sweep tasks) so they start under the same rule; a value the user exported is theirs and is left alone.
GLIBC_MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"

_applied: Optional[str] = None


def _glibc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def parse_mmap_threshold(raw: Optional[str]) -> Optional[int]:
    """``STALERL_MALLOC_MMAP_THRESHOLD``'s value: None for ``keep`` or unset (glibc's default), else bytes. Raises
    ValueError naming the variable for anything else."""
    if raw is None or raw.strip() == "" or raw.strip().lower() == "keep":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    # glibc refuses thresholds above HEAP_MAX / 2 (32 MiB on 64-bit); 0 would mmap every small allocation.
    if not 4096 <= value <= 32 * 2**20:
        raise ValueError(f"{MALLOC_MMAP_THRESHOLD_ENV}={raw!r}: expected a byte count from 4096 to 33554432, or "
                         f"'keep' (or unset) for glibc's default. Fix: e.g. {DEFAULT_MMAP_THRESHOLD}, the measured setting")
    return value


def configure_allocator() -> str:
    """Fix glibc malloc's mmap threshold for this process (see :data:`DEFAULT_MMAP_THRESHOLD`), once, and return
    the phrase the start line prints (``"malloc: ..."``). Called by the launcher before torch is imported, so that no
    tensor was allocated under the dynamic rule; any later call returns the first call's phrase. Not glibc (macOS,
    musl): nothing to do, and it says so. ``STALERL_MALLOC_MMAP_THRESHOLD=keep`` leaves glibc's default; a
    ``MALLOC_MMAP_THRESHOLD_`` the user exported (glibc applied it at start) is kept too. Child processes inherit
    the setting through ``MALLOC_MMAP_THRESHOLD_``."""
    global _applied
    if _applied is not None:
        return _applied
    threshold = parse_mmap_threshold(os.environ.get(MALLOC_MMAP_THRESHOLD_ENV))
    libc = _glibc()
    own = os.environ.get(GLIBC_MMAP_THRESHOLD_ENV)
    if own is not None and threshold is not None:
        _applied = f"malloc: mmap threshold {own} from {GLIBC_MMAP_THRESHOLD_ENV} (set before the start)"
    elif threshold is None:
        _applied = (f"malloc: glibc's default mmap threshold ({MALLOC_MMAP_THRESHOLD_ENV} unset or keep; "
                    f"{DEFAULT_MMAP_THRESHOLD} returns freed buffers to the kernel: less RSS, slower steps)")
    elif libc is None:
        _applied = "malloc: not glibc, allocator left as it is"
    elif libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold)) != 1:
        _applied = f"malloc: glibc refused mmap threshold {threshold}; default kept"
    else:
        os.environ[GLIBC_MMAP_THRESHOLD_ENV] = str(threshold)  # the same rule in every child process
        _applied = (f"malloc: buffers >= {threshold // 1024} KiB mmapped and returned when freed "
                    f"({MALLOC_MMAP_THRESHOLD_ENV}; unset for glibc's default)")
    return _applied
