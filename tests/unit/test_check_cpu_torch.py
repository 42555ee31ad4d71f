"""scripts/check_cpu_torch.py (run by scripts/setup.sh): a CUDA build of torch is detected from torch's CUDA version
or from the packages pip installed beside it (fake environments), and the CPU build passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_cpu_torch.py"
spec = importlib.util.spec_from_file_location("check_cpu_torch", SCRIPT)
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_cpu_build_passes_and_cuda_builds_fail():
    ok, line = check.verdict("2.13.0+cpu", None, ["torch", "numpy", "transformers"])
    assert ok and "CPU build" in line
    ok, line = check.verdict("2.13.0", "13.0", ["torch", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"])
    assert not ok
    assert "torch.version.cuda=13.0" in line and "nvidia-cudnn-cu13" in line and "triton" in line
    assert line.startswith("stalerl: error:") and "STALERL_TORCH_INDEX" in line and "\n" not in line
    ok, line = check.verdict("2.13.0", None, ["Nvidia-NCCL-cu12"])  # leftover CUDA packages alone also fail
    assert not ok and "nvidia-nccl-cu12" in line


def test_this_environment_is_the_cpu_build():
    assert check.main() == 0
