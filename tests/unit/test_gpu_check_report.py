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


_bspec = importlib.util.spec_from_file_location("gpu_check_bench", REPO / "scripts" / "gpu_check_bench.py")
bench_mod = importlib.util.module_from_spec(_bspec)
_bspec.loader.exec_module(bench_mod)

MEASURED = {
    "logprob": {"run": True, "device": "cuda", "dtype": "bfloat16", "hidden": 1536, "vocab": 151936, "tokens": 16384,
                "chunk_tokens": 1766, "chunked_s": 0.12, "plain_s": 0.1, "time_ratio": 1.2, "chunked_peak_gib": 1.5,
                "plain_peak_gib": 20.0},
    "vllm": {"run": True, "variants": [
        {"ok": True, "enforce_eager": False, "tokens_per_s": 9000.0, "weight_sync": "ipc", "sync_s": [0.2, 0.1]},
        {"ok": True, "enforce_eager": True, "tokens_per_s": 3000.0, "weight_sync": "ipc", "sync_s": [0.2, 0.1]}]},
    "nccl": {"run": False, "why": "needs 2 GPUs, 1 visible"},
}


def test_report_carries_the_measurements_and_prints_each_figure(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in ({"step": 0}, _row(1), _row(2))) + "\n")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(MEASURED))
    out = tmp_path / "report.json"
    assert report_mod.main([str(run), "--steps", "2", "--bench", str(bench), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["bench"] == MEASURED
    text = report_mod.format_report(data)
    assert "chunked (1766 tokens/chunk) 0.12 s, plain 0.1 s (1.20x)" in text
    assert "vllm with CUDA graphs: 9000 generated tokens/s; weight sync ipc: 0.2, 0.1 s per sync" in text
    assert "vllm without CUDA graphs: 3000 generated tokens/s" in text
    assert "nccl: not run: needs 2 GPUs, 1 visible" in text
    # a measurement that crashed fails the check, named; a missing file too
    failed = dict(MEASURED, vllm={"run": True, "variants": [{"ok": False, "exit_code": 1, "tail": "CUDA OOM"}]})
    bench.write_text(json.dumps(failed))
    assert report_mod.main([str(run), "--steps", "2", "--bench", str(bench), "--out", str(out)]) == 1
    assert any("measurement vllm failed: CUDA OOM" in p for p in json.loads(out.read_text())["problems"])
    assert report_mod.main([str(run), "--steps", "2", "--bench", str(tmp_path / "none.json"), "--out", str(out)]) == 1
    assert "no measurements" in " ".join(json.loads(out.read_text())["problems"])


def test_vllm_measurements_say_why_they_are_skipped(monkeypatch):
    import importlib.util as iu

    monkeypatch.setenv("STALERL_CHECK_VLLM", "0")
    assert bench_mod.vllm_skip_reason("cuda", 1) == "STALERL_CHECK_VLLM=0"
    monkeypatch.delenv("STALERL_CHECK_VLLM")
    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert "not importable" in bench_mod.vllm_skip_reason("cuda", 1)
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert bench_mod.vllm_skip_reason("cuda", 1) is None
    assert bench_mod.vllm_skip_reason("cuda", 1, need_gpus=2) == "needs 2 GPUs, 1 visible"  # nccl: two GPUs


def test_a_crashing_measurement_is_recorded_and_the_others_still_run():
    def boom():
        raise RuntimeError("NCCL error")

    part = bench_mod._guarded(boom)
    assert part["ok"] is False and "NCCL error" in part["why"]
    assert bench_mod.bench_problems({"nccl": part, "vllm": {"run": False, "why": "x"}}) == [
        "measurement nccl failed: RuntimeError: NCCL error"]


def test_vllm_child_measures_one_engine_and_writes_its_result(tmp_path, monkeypatch):
    """The child's command line (what _child runs) parses, and vllm_variant's flow over an engine stand-in: start,
    warm-up and measured generation, two syncs on the path the engine chose (no vLLM here)."""
    import torch
    from types import SimpleNamespace

    calls = []

    class Engine:
        weight_sync, last_sync_seconds = "ipc", 0.25

        def __init__(self, options):
            self.options = options

        def set_version(self, v):
            calls.append(("set_version", v))

        def generate(self, questions, answers, **kw):
            calls.append(("generate", len(questions), kw["max_new_tokens"]))
            return SimpleNamespace(num_response_tokens=len(questions) * kw["max_new_tokens"])

        def close(self):
            calls.append(("close",))

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(bench_mod, "_policy", lambda d, dev: (model, None))
    monkeypatch.setattr(bench_mod, "_options", lambda eager: SimpleNamespace(enforce_eager=eager))
    monkeypatch.setattr(bench_mod, "_engine", lambda m, t, w, o, track_source: Engine(o))
    out = tmp_path / "result.json"
    assert bench_mod.main(bench_mod.child_argv("graphs", "cpu", tmp_path / "model", out)) == 0
    result = json.loads(out.read_text())
    assert result["enforce_eager"] is False and result["weight_sync"] == "ipc" and result["sync_s"] == [0.25, 0.25]
    g = bench_mod.GEN["cpu"]
    assert result["tokens"] == g["prompts"] * g["max_new_tokens"] and result["tokens_per_s"] > 0
    assert calls == [("set_version", 0), ("generate", g["prompts"], g["max_new_tokens"]),
                     ("generate", g["prompts"], g["max_new_tokens"]), ("set_version", 1), ("set_version", 2),
                     ("close",)]
