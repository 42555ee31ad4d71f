"""scripts/gpu_check_report.py: the real-scale part of the GPU check fails on exactly the problems it names."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("gpu_check_report", REPO / "scripts" / "gpu_check_report.py")
report_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report_mod)


def _row(step: int, **over) -> dict:
    row = {"step": step, "actor/loss": 0.5, "actor/grad_norm": 0.3, "timing/step_s": 10.0,
           "timing/split/generation_s": 6.0, "timing/split/logp_s": 1.0, "timing/split/training_s": 2.5,
           "throughput/gen_tokens_per_s": 1000.0, "memory/gpu_peak_allocated_gib": 30.0 + step,
           "memory/gpu_peak_reserved_gib": 35.0 + step}
    row.update(over)
    return row


def test_a_complete_run_passes_with_its_peaks():
    rows = [{"step": 0}, _row(1), _row(2)]
    rep = report_mod.build_report(rows, steps=2, exit_code=0, device="cuda", smi_peak_mib=40_000.0)
    assert rep["ok"] and rep["problems"] == []
    assert rep["peak_memory_gib"] == {"gpu_peak_allocated_gib": 32.0, "gpu_peak_reserved_gib": 37.0}
    assert [s["generation_s"] for s in rep["per_step"]] == [6.0, 6.0]
    text = report_mod.format_report(rep)
    assert "PASS" in text and "gpu_peak_allocated_gib 32.00 GiB" in text and "39.06 GiB" in text


@pytest.mark.parametrize("rows, exit_code, words", [
    ([_row(1)], 0, "logged steps [1], expected 1..2"),
    ([_row(1), _row(2, **{"actor/grad_norm": 0.0})], 0, "step 2: zero gradient"),
    ([_row(1), _row(2, **{"actor/loss": float("nan")})], 0, "step 2: actor/loss = nan"),
    ([_row(1), _row(2)], 124, "run exited with code 124"),
])
def test_each_problem_fails_the_check_and_is_named(rows, exit_code, words):
    rep = report_mod.build_report(rows, steps=2, exit_code=exit_code, device="cuda", smi_peak_mib=None)
    assert not rep["ok"] and any(words in p for p in rep["problems"]), rep["problems"]


def test_main_writes_the_json_and_reads_nvidia_smi(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in ({"step": 0}, _row(1), _row(2))) + "\n")
    smi = tmp_path / "smi.csv"
    smi.write_text("1024\n40960\nnot a number\n2048\n")
    out = tmp_path / "report.json"
    assert report_mod.main([str(run), "--steps", "2", "--nvidia-smi", str(smi), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["nvidia_smi_peak_mib"] == 40960.0
    assert report_mod.main([str(tmp_path / "missing"), "--steps", "2", "--out", str(out)]) == 1
    assert "no metrics" in " ".join(json.loads(out.read_text())["problems"])
