"""What this machine's matmul units do well: the choice behind ``actor.dtype=auto`` (issue 43 item 4).

bf16 pays on a CPU only where it has native bf16 dot products: AMX-BF16 (Intel Sapphire Rapids and later) or
AVX512-BF16 (Intel Cooper Lake, AMD Zen 4 and later). Elsewhere ATen emulates bf16 by widening to fp32, and a bf16
matmul is several times slower than an fp32 one (bench/real_model_limits.py prints the ratio on the machine it runs
on). On CUDA, bf16 wherever the card supports it (Ampere and later)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

# /proc/cpuinfo flags of native bf16 dot products, the faster first
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")

#: The vector extensions that choose ATen's CPU kernels (and so the rounding of a trajectory) and whether bf16 is
#: native, as /proc/cpuinfo names them: what run summaries and benches record of a machine.
CPU_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The flags of the first processor listed (x86 Linux); empty where there is no such file or line."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_isa(flags: Optional[set[str]] = None) -> list[str]:
    """The CPU_ISA_FLAGS this CPU has, in that order (``flags`` default to this machine's)."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in CPU_ISA_FLAGS if f in flags]


def auto_compute_dtype(device_type: str, flags: Optional[set[str]] = None,
                       cuda_bf16: Optional[bool] = None) -> tuple[str, str]:
    """``(dtype, why)`` for ``actor.dtype=auto`` on ``device_type`` ("cpu" or "cuda"): bfloat16 where the hardware
    multiplies bf16 natively, else float32; ``why`` is the one line the run logs. ``flags`` / ``cuda_bf16`` default
    to this machine's (tests pass their own)."""
    if device_type == "cuda":
        if cuda_bf16 is None:
            import torch

            cuda_bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if cuda_bf16:
            return "bfloat16", "CUDA with bf16 support: bf16 autocast (fp32 master weights)"
        return "float32", "this GPU has no bf16 support: float32"
    flags = cpu_flags() if flags is None else flags
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    if native:
        return "bfloat16", (f"this CPU has {native[0]} (native bf16 matmuls): bf16 autocast, fp32 master weights; "
                            "the engine-vs-trainer mismatch grows (mismatch/*), rollout_correction is the remedy")
    return "float32", ("this CPU has neither AMX-BF16 nor AVX512-BF16, so bf16 matmuls would be emulated and slower "
                       "than float32: float32")
