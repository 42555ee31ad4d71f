"""scripts/gpu_check.sh in its CPU dry mode (STALERL_SMOKE_DEVICE=cpu): the same command a GPU slot runs, at tiny
sizes, including the offline install of the prepared wheels (scripts/prepare_gpu_wheels.sh) it needs on a bare image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_gpu_check_cpu_dry_mode_reports_the_split_and_runs_the_smoke(tmp_path):
    wheels = tmp_path / "whl"
    env = dict(os.environ, PYTHON=sys.executable)
    prep = subprocess.run(["bash", "scripts/prepare_gpu_wheels.sh", str(wheels)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-2000:]
    names = sorted(p.name for p in wheels.glob("*.whl"))
    assert [n.split("-")[0] for n in names] == ["antlr4_python3_runtime", "omegaconf"], names
    assert all(n.endswith("-py3-none-any.whl") for n in names)

    report = tmp_path / "report.json"
    env.update(STALERL_SMOKE_DEVICE="cpu", STALERL_SMOKE_DIR=str(tmp_path / "work"), STALERL_CHECK_WHEELS=str(wheels),
               STALERL_CHECK_FORCE_WHEELS="1", STALERL_CHECK_REPORT=str(report),
               STALERL_CHECK_NO_PIP="1")  # as on an image without pip: the pure-Python wheels are unpacked
    res = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1800)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # omegaconf came from the carried wheels, as on a bare CUDA image
    assert out.startswith("gpu_check: wheels: antlr4_python3_runtime-")  # the first line says what was carried
    assert "unpacked (no pip) antlr4_python3_runtime-4.9.3-py3-none-any.whl omegaconf-" in out
    assert str(tmp_path / "work" / "pydeps") in out

    data = json.loads(report.read_text())
    assert data["ok"] and [s["step"] for s in data["per_step"]] == [1, 2]
    for s in data["per_step"]:
        assert s["generation_s"] > 0 and s["logp_s"] > 0 and s["training_s"] > 0  # M2PO's selection pass: log-probs
        assert s["generation_s"] + s["logp_s"] + s["training_s"] <= s["step_s"]
        assert s["gen_tokens_per_s"] > 0 and s["micro_batches"] >= 1
    assert [s["staleness_avg"] for s in data["per_step"]] == [0, 1]  # rollout.fixed_staleness=1
    assert data["peak_memory_gib"]["peak_rss_gib"] > 0
    # behavior_logp=rollout: the engine mismatch on step 0's fresh data (logged in step 1's row), and the sync path
    assert data["mismatch_step0"]["mismatch/tokens"] > 0 and data["mismatch_step0"]["mismatch/m2"] >= 0
    assert data["weight_sync_path"].startswith("none: the HF engine")
    # the measurements (scripts/gpu_check_bench.py): chunked vs plain log-probs at the CPU's chunk; the vLLM parts
    # say why they did not run (no vLLM in this venv; nccl needs CUDA)
    lp = data["bench"]["logprob"]
    assert lp["run"] and lp["chunk_tokens"] == 27 and lp["chunked_s"] > 0 and lp["plain_s"] > 0
    assert not data["bench"]["vllm"]["run"] and data["bench"]["vllm"]["why"]
    assert not data["bench"]["nccl"]["run"] and "CUDA" in data["bench"]["nccl"]["why"]
    assert "log-probs fwd+bwd, 64 tokens" in out and "vllm: not run: " in out and "nccl: not run: " in out
    for case in ("single-gpu-torch-d1", "async-torch-d2", "async-fsdp-d2"):
        assert f"PASS {case}" in out, out[-4000:]
    assert "real scale PASS, smoke runs PASS" in out
