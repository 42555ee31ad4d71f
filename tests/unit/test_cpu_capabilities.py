"""scripts/cpu_capabilities.py: which ATEN_CPU_CAPABILITY values scripts/test_isa.sh runs, from /proc/cpuinfo flags
(fake texts of an AVX2-only AMD EPYC, an AVX512-BF16 Xeon, an ARM CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_capabilities.py"
spec = importlib.util.spec_from_file_location("cpu_capabilities", SCRIPT)
caps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(caps)

EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx fma avx2 bmi2 sha_ni\n\n" \
       "processor\t: 1\nflags\t\t: fpu sse sse2 avx fma avx2 bmi2 sha_ni\n"
XEON = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx fma avx2 avx512f avx512dq avx512cd avx512bw " \
       "avx512vl avx512_vnni avx512_bf16 amx_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"


def test_capabilities_from_flags(tmp_path, capsys):
    assert caps.supported_capabilities(caps.cpu_flags(EPYC)) == ["default", "avx2"]
    assert caps.supported_capabilities(caps.cpu_flags(XEON)) == ["default", "avx2", "avx512"]
    assert caps.supported_capabilities(caps.cpu_flags(ARM)) == ["default"]
    # avx512f alone is not ATen's avx512 (it needs vl, bw, dq)
    assert caps.supported_capabilities({"avx2", "fma", "avx512f"}) == ["default", "avx2"]
    f = tmp_path / "cpuinfo"
    f.write_text(XEON)
    caps.main(["--cpuinfo", str(f)])
    assert capsys.readouterr().out.split() == ["default", "avx2", "avx512"]
    caps.main(["--cpuinfo", str(tmp_path / "missing")])
    assert capsys.readouterr().out.split() == ["default"]
