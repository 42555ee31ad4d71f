"""The ATEN_CPU_CAPABILITY values this x86 CPU supports, one per line: ``default`` (ATen's scalar kernels, always),
``avx2`` and ``avx512`` when /proc/cpuinfo has the flags ATen checks before it dispatches to them (ATen's
DispatchStub: avx2 needs avx2 + fma; avx512 needs avx512vl + avx512bw + avx512dq + fma). A CPU without a
/proc/cpuinfo (or not x86) lists ``default`` only. scripts/test_isa.sh runs the ISA-sensitive tests under each.

    python3 scripts/cpu_capabilities.py [--cpuinfo FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

REQUIRED = {"avx2": {"avx2", "fma"}, "avx512": {"avx512vl", "avx512bw", "avx512dq", "fma"}}


def cpu_flags(cpuinfo_text: str) -> set[str]:
    """The flags of the first processor in a /proc/cpuinfo text (x86: the ``flags`` line)."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def supported_capabilities(flags: set[str]) -> list[str]:
    return ["default", *[cap for cap, need in REQUIRED.items() if need <= flags]]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpuinfo", type=Path, default=Path("/proc/cpuinfo"))
    args = parser.parse_args(argv)
    text = args.cpuinfo.read_text() if args.cpuinfo.is_file() else ""
    print("\n".join(supported_capabilities(cpu_flags(text))))


if __name__ == "__main__":
    main()
