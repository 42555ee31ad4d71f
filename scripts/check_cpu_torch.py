"""After scripts/setup.sh: is the installed torch a CPU build? Fails (exit 1, one line naming what was found and the
fix) when torch reports a CUDA version or CUDA packages (nvidia-*, triton) came with it; prints what it checked.

    python3 scripts/check_cpu_torch.py
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Iterable, Optional

CUDA_PACKAGE_PREFIXES = ("nvidia-", "triton")


def cuda_packages(names: Iterable[str]) -> list[str]:
    """Installed distributions that belong to a CUDA build of torch (nvidia-cudnn-cu13, nvidia-nccl-..., triton)."""
    return sorted({n.lower() for n in names if n.lower().startswith(CUDA_PACKAGE_PREFIXES)})


def verdict(torch_version: str, torch_cuda: Optional[str], names: Iterable[str]) -> tuple[bool, str]:
    found = cuda_packages(names)
    if torch_cuda is None and not found:
        return True, f"torch {torch_version} is a CPU build (torch.version.cuda is None, no nvidia-*/triton packages)"
    what = ", ".join(([f"torch.version.cuda={torch_cuda}"] if torch_cuda else []) + found)
    return False, (f"stalerl: error: torch {torch_version} is not the CPU build ({what}); fix: "
                   f"pip uninstall -y torch {' '.join(found)} and rerun scripts/setup.sh with "
                   "STALERL_TORCH_INDEX=https://download.pytorch.org/whl/cpu (or a local CPU wheel)")


def main() -> int:
    import torch

    names = [d.metadata["Name"] or "" for d in importlib.metadata.distributions()]
    ok, line = verdict(torch.__version__, torch.version.cuda, names)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
