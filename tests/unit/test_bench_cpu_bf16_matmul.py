"""bench/cpu_bf16_matmul.py runs and prints its table: the machine line and one row per layout (the times are
never asserted: bench/ is not timed in tests)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_bf16_matmul_bench_prints_every_layout_of_a_shape():
    res = subprocess.run([sys.executable, "bench/cpu_bf16_matmul.py", "--only", "mlp", "--repeats", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("torch ") and "bf16 units: " in lines[0]
    rows = [ln.split() for ln in lines[2:]]
    assert len(rows) == 4, res.stdout
    assert [" ".join(r[2:-4]) for r in rows] == ["A B", "A^T B", "A B^T", "A^T B^T"]
    for r in rows:
        f32, b16, ratio = float(r[-4]), float(r[-3]), float(r[-2])
        assert f32 > 0 and b16 > 0 and abs(ratio - b16 / f32) <= 0.05 * ratio + 0.05
