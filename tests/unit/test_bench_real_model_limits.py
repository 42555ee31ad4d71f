"""bench/real_model_limits.py runs against today's trainer (it reaches into the trainer's rollout source, which moved
once without the bench noticing): the whole script on the embedded tiny model, one train step and a few generated
tokens, every section printed. The figures themselves are never asserted (bench/ is not timed in tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_limits_bench_runs_end_to_end_on_the_tiny_model(tmp_path):
    cmd = [sys.executable, "bench/real_model_limits.py", "--model", "tiny:qwen2", "--config",
           "examples/math/gsm8k_m2po_cpu.yaml", "--threads", "1", "--steps", "1", "--gen-tokens", "4",
           "--batches", "1,2", "train_dataset.batch_size=2", "gconfig.n_samples=2", "warm_start.steps=0",
           "evaluator.at_start=false"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    for words in ("limits: fp32 GEMM 2048^3", "train step 1:", "training: ", "x the fp32 GEMM", "generation batch 1:",
                  "generation batch 2:", "static / generate"):
        assert words in out, (words, out[-3000:])
