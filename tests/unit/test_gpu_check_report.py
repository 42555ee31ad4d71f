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
    why = bench_mod.vllm_skip_reason("cuda", 1)  # the real cause: the image's torch against vLLM's pin, no registry
    assert "not importable" in why and "pin torch 2.13 / 2.14" in why and "no package registry" in why
    assert "tested on CPU only" in why and "install stalerl[vllm]" not in why
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


# ------------------------------------------------------------------------------------------------ real model
def _model_row(step: int, abs_mean: float = 2e-6, **over) -> dict:
    row = _row(step, **{"actor/grad_norm": 0.0, "timing/split/forward_backward_s": 2.0,
                        "timing/split/optimizer_s": 0.5, "throughput/train_tokens_per_s": 500.0 * step,
                        "mismatch/abs_mean": abs_mean, "mismatch/m2": abs_mean ** 2, "mismatch/max_abs": 10 * abs_mean,
                        "mismatch/abs_p99": 5 * abs_mean, "mismatch/frac_gt_0.1": 0.0, "mismatch/mean": 0.0,
                        "mismatch/tokens": 100.0 * step})
    row.update(over)
    return row


def test_real_model_runs_report_the_mismatch_and_check_the_float32_engine():
    rows = [{"step": 0}, _model_row(1), _model_row(2, abs_mean=4e-6, **{"timing/eval_s": 1.5})]
    rep = report_mod.build_report(rows, steps=2, exit_code=0, device="cuda", smi_peak_mib=None, kind="real_model",
                                  variant="float32")
    assert rep["ok"], rep["problems"]  # a zero gradient is no problem here (a group without reward signal)
    mm = rep["mismatch"]
    assert mm["steps"] == 2 and mm["tokens"] == 300 and mm["abs_mean"] == pytest.approx((2e-6 * 100 + 4e-6 * 200) / 300)
    assert mm["max_abs"] == pytest.approx(4e-5) and mm["abs_p99"] == pytest.approx(2e-5)
    assert rep["summary"]["train_tokens_per_s"] == 1000.0 and rep["summary"]["steps_in_means"] == [2]
    assert rep["summary"]["eval_s"] == 1.5 and rep["summary"]["peak_memory_gib"] == 37.0
    (check,) = rep["checks"]
    assert check["passed"] and check["tolerance"] == report_mod.FP32_MISMATCH_TOL and check["rule"]
    assert "engine mismatch over 2 steps, 300 tokens" in report_mod.format_report(rep)
    # float32 engine and trainer disagreeing, or no mismatch logged at all: named problems
    bad = report_mod.build_report([_model_row(1, abs_mean=1e-3), _model_row(2)], steps=2, exit_code=0, device="cuda",
                                  smi_peak_mib=None, kind="real_model", variant="float32")
    assert not bad["ok"] and any("float32 engine mismatch" in p for p in bad["problems"])
    bf16 = report_mod.build_report([_model_row(1, abs_mean=0.02), _model_row(2, abs_mean=0.02)], steps=2, exit_code=0,
                                   device="cuda", smi_peak_mib=None, kind="real_model", variant="bfloat16")
    (check,) = bf16["checks"]  # bf16's mismatch has its stated upper bound
    assert bf16["ok"] and check["passed"] and check["tolerance"] == 0.1 and bf16["warnings"] == []
    none = [{k: v for k, v in _model_row(s).items() if not k.startswith("mismatch/")} for s in (1, 2)]
    rep = report_mod.build_report(none, steps=2, exit_code=0, device="cuda", smi_peak_mib=None, kind="real_model",
                                  variant="bfloat16")
    assert not rep["ok"] and any("no mismatch" in p for p in rep["problems"])
    # the real-scale run still requires a gradient (its shifted rewards always train)
    rep = report_mod.build_report([_model_row(1), _model_row(2)], steps=2, exit_code=0, device="cuda",
                                  smi_peak_mib=None)
    assert not rep["ok"] and any("zero gradient" in p for p in rep["problems"])


# ------------------------------------------------------------------------------------------------ the whole check
def _check_dir(tmp_path, lines, numerics_ok=True):
    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    (out / "logs").mkdir()
    (out / "parts.tsv").write_text("".join("\t".join(str(c) for c in line) + "\n" for line in lines))
    entry = {"check": "loss/m2po", "dtype": "float32", "quantity": "loss", "error": 1e-8 if numerics_ok else 1.0,
             "tolerance": 2e-5, "comparison": "<=", "rule": "r", "passed": numerics_ok}
    (out / "parts" / "numerics.json").write_text(json.dumps({
        "entries": [entry], "errors": [], "ok": numerics_ok,
        "summary": {"checks": 1, "passed": int(numerics_ok), "errors": [],
                    "failed": [] if numerics_ok else ["loss/m2po [float32] loss: 1 (tolerance <= 2e-05)"]}}))
    run = report_mod.build_report([_model_row(1), _model_row(2)], steps=2, exit_code=0, device="cpu",
                                  smi_peak_mib=None, kind="real_model", variant="float32")
    (out / "parts" / "real_model_float32.json").write_text(json.dumps(run))
    (out / "parts" / "bench.json").write_text(json.dumps(MEASURED))
    (out / "logs" / "smoke.log").write_text("smoke: PASS single-gpu-torch-d1 in 9s: ok\n"
                                            "smoke: SKIP async-torch-d2: needs 3 GPUs (one per rank), 1 visible\n")
    return out


PASSED = [("environment", "pass", 5, 120, ""), ("numerics", "pass", 20, 90, ""),
          ("real_model/vllm", "skipped", 0, 0, "vLLM is not importable here"),
          ("real_model/float32", "pass", 30, 70, ""), ("real_model", "pass", 60, 150, ""),
          ("real_scale", "pass", 100, 180, ""), ("bench", "pass", 20, 60, ""),
          ("smoke", "skipped", 0, 0, "budget (optional part): 100s left for it ...")]


def test_the_check_report_passes_lists_what_was_skipped_and_why(tmp_path):
    out = _check_dir(tmp_path, PASSED)
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "300"]) == 0
    data = json.loads((out / report_mod.REPORT).read_text())
    s = data["summary"]
    assert s["verdict"] == "PASS" and s["within_budget"] and s["incomplete"] == []
    assert s["parts"] == {"environment": "pass", "numerics": "pass", "real_model": "pass", "real_scale": "pass",
                          "bench": "pass", "smoke": "skipped"}
    assert s["numerics"] == {"checks": 2, "passed": 2, "failed": 0}  # + the real model's float32 engine check
    assert s["real_model"]["float32"]["mismatch"]["abs_mean"] > 0
    whats = {x["what"]: x["why"] for x in data["skipped"]}
    assert whats["real_model/vllm"] == "vLLM is not importable here" and whats["bench/nccl"].startswith("needs 2")
    assert whats["smoke"].startswith("budget (optional part)") and whats["smoke/async-torch-d2"].startswith("needs 3")
    assert all(why for why in whats.values())


@pytest.mark.parametrize("change, verdict, code, words", [
    (("real_scale", "cut", 180, 180, "its 180s slice ran out"), "INCOMPLETE", 3, "cut after 180s: its 180s slice"),
    (("real_scale", "skipped", 0, 0, "budget: 40s left for it"), "INCOMPLETE", 3, "budget: 40s"),
    (("real_scale", "fail", 50, 180, ""), "FAIL", 1, "real_scale failed"),
])
def test_a_cut_or_budget_skipped_part_is_incomplete_and_a_failed_one_fails(tmp_path, change, verdict, code, words):
    lines = [change if line[0] == change[0] else line for line in PASSED]
    out = _check_dir(tmp_path, lines)
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "400"]) == code
    s = json.loads((out / report_mod.REPORT).read_text())["summary"]
    assert s["verdict"] == verdict
    assert any(words in x for x in s["skipped"] + s["problems"]), s


def test_a_failed_comparison_fails_the_check(tmp_path):
    out = _check_dir(tmp_path, PASSED, numerics_ok=False)
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "100"]) == 1
    s = json.loads((out / report_mod.REPORT).read_text())["summary"]
    assert s["numerics"]["failed"] == 1 and any("loss/m2po [float32] loss" in p for p in s["problems"])



# ------------------------------------------------------------------------------------------------ issue 45's rules
def test_a_broken_bf16_engine_fails_the_mismatch_bound_and_an_exact_zero_warns():
    """The bf16 engine's mismatch has an upper bound (4x the largest measured): an engine 0.5 off fails; an exact 0
    passes with a WARNING (a blind probe and bit-identical kernels look the same without the control)."""
    broken = report_mod.build_report([_model_row(1, abs_mean=0.5), _model_row(2, abs_mean=0.5)], steps=2, exit_code=0,
                                     device="cuda", smi_peak_mib=None, kind="real_model", variant="bfloat16")
    assert not broken["ok"] and any("bf16 engine mismatch mean |d| 0.5 > 0.1" in p for p in broken["problems"])
    zero = report_mod.build_report([_model_row(1, abs_mean=0.0), _model_row(2, abs_mean=0.0)], steps=2, exit_code=0,
                                   device="cuda", smi_peak_mib=None, kind="real_model", variant="bfloat16")
    assert zero["ok"] and len(zero["warnings"]) == 1 and "exactly 0 on 300 tokens" in zero["warnings"][0]
    assert "WARNING: bfloat16 engine mismatch is exactly 0" in report_mod.format_report(zero)
    # the 1.5B shape's bf16 engine at step 0 has the same bound
    rs = report_mod.build_report([_row(1, **{"mismatch/abs_mean": 0.3, "mismatch/m2": 0.1, "mismatch/max_abs": 1.0,
                                             "mismatch/tokens": 10.0}), _row(2)], steps=2, exit_code=0, device="cuda",
                                 smi_peak_mib=None)
    assert not rs["ok"] and any("mismatch at step 0" in p for p in rs["problems"])


@pytest.mark.parametrize("rc, elapsed, limit, status, words", [
    (0, 10, 60, "pass", ""),
    (124, 60, 60, "cut", "its 60s slice ran out"),
    (137, 59, 60, "cut", "its 60s slice ran out"),  # timeout's -k kill after the slice (SECONDS can read one short)
    (137, 12, 60, "fail", "killed (signal 9; OOM?) after 12s of its 60s slice"),
    (124, 12, 60, "fail", "exit code 124"),
    (143, 30, 60, "fail", "killed (signal 15; OOM?)"),
    (1, 5, 60, "fail", "exit code 1"),
])
def test_cut_only_when_the_slice_ran_out_else_killed_is_a_failure(rc, elapsed, limit, status, words):
    got, why = report_mod.exit_status(rc, elapsed, limit)
    assert got == status and words in why
    assert report_mod.main(["status", str(rc), str(elapsed), str(limit)]) == 0


def test_a_cut_recorded_before_its_slice_ran_out_fails_the_check(tmp_path):
    lines = [("real_scale", "cut", 20, 180, "") if line[0] == "real_scale" else line for line in PASSED]
    out = _check_dir(tmp_path, lines)
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "300"]) == 1
    s = json.loads((out / report_mod.REPORT).read_text())["summary"]
    assert s["verdict"] == "FAIL" and any("killed after 20s of its 180s slice" in p for p in s["problems"])


def test_real_model_cut_by_a_runs_share_is_incomplete_not_a_kill(tmp_path):
    """real_model's own row when one of its runs ran out of its share (the run's row: cut at its limit): the part
    row carries no slice of its own (limit 0), so it is INCOMPLETE, not 'killed before its slice ran out' (the
    CPU dry mode under load 14 recorded real_model cut at 452 s of 480 with its 480 s slice, and failed)."""
    lines = [line for line in PASSED if line[0] not in ("real_model", "real_model/float32")] + [
        ("real_model/float32", "cut", 61, 60, "its 60s share of the part's slice ran out"),
        ("real_model", "cut", 140, 0, "a run was cut by its share of the part's 150s slice")]
    out = _check_dir(tmp_path, lines)
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "300"]) == 3
    s = json.loads((out / report_mod.REPORT).read_text())["summary"]
    assert s["verdict"] == "INCOMPLETE" and s["problems"] == [] and "real_model" in s["incomplete"]


@pytest.mark.parametrize("device, why, verdict, code", [
    ("cuda", "no SmolLM2-135M-Instruct.Q4_1.gguf in ../shared/models (carry ...)", "INCOMPLETE", 3),
    ("cpu", "no SmolLM2-135M-Instruct.Q4_1.gguf in ../shared/models (carry ...)", "PASS", 0),
    ("cuda", "the environment failed", "INCOMPLETE", 3),
])
def test_real_model_not_run_on_cuda_is_incomplete(tmp_path, device, why, verdict, code):
    lines = [line for line in PASSED if not line[0].startswith("real_model")] + [("real_model", "skipped", 0, 0, why)]
    out = _check_dir(tmp_path, lines)
    (out / "parts" / "real_model_float32.json").unlink()
    assert report_mod.main(["assemble", str(out), "--device", device, "--budget", "420", "--elapsed", "300"]) == code
    s = json.loads((out / report_mod.REPORT).read_text())["summary"]
    assert s["verdict"] == verdict and (("real_model" in s["incomplete"]) == (verdict == "INCOMPLETE"))


def test_a_parts_run_is_partial_never_pass_and_says_when_nothing_was_compared(tmp_path):
    lines = [("environment", "pass", 5, 120, ""), ("numerics", "skipped", 0, 0, "not selected (--parts bench)"),
             ("real_model", "skipped", 0, 0, "not selected (--parts bench)"), ("bench", "pass", 20, 60, "")]
    out = _check_dir(tmp_path, lines)
    for f in ("numerics.json", "real_model_float32.json"):
        (out / "parts" / f).unlink()
    code = report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "30",
                            "--selected", "bench"])
    data = json.loads((out / report_mod.REPORT).read_text())
    assert code == 4 and data["summary"]["verdict"] == "PARTIAL" and not data["ok"]
    text = report_mod.format_check(data)
    assert "PARTIAL (--parts bench)" in text and "comparisons: none ran" in text
    # the same files without --selected: the "not selected" skips alone make it PARTIAL
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "30"]) == 4


def _control(engine=0.01, float32=0.02, micro=0.0, plain=0.0):
    mc = report_mod._mismatch_module()
    fig = lambda v: {"mismatch/abs_mean": v, "mismatch/max_abs": 10 * v, "mismatch/tokens": 80.0}  # noqa: E731
    controls = {"float32": fig(float32), "micro_batch": fig(micro), "plain_head": fig(plain)}
    return {"dtype": "bfloat16", "engine_vs_trainer": fig(engine), "controls": controls,
            "entries": mc.control_entries("bfloat16", fig(engine), controls),
            "warnings": mc.warnings_for("bfloat16", fig(engine), controls), "tokens_file": "t.json"}


@pytest.mark.parametrize("control, verdict, words", [
    (_control(), "PASS", None),
    (_control(float32=0.0), "FAIL", "mismatch_control/float32_rescore"),  # a blind comparison
    (_control(engine=0.4), "FAIL", "mismatch_control/engine_vs_trainer"),  # a broken engine
    (_control(engine=0.0), "PASS", "exactly 0 on 80 tokens"),  # a real 0, with the control seeing 0.02: a warning
])
def test_the_mismatch_control_fails_a_blind_comparison_or_a_broken_engine(tmp_path, control, verdict, words):
    out = _check_dir(tmp_path, PASSED)
    (out / "parts" / "mismatch_control.json").write_text(json.dumps(control))
    report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "300"])
    data = json.loads((out / report_mod.REPORT).read_text())
    s = data["summary"]
    assert s["verdict"] == verdict, s
    if words:
        assert any(words in x for x in s["problems"] + s["warnings"]), s
    assert s["mismatch_control"]["controls"]["float32"]["mismatch/abs_mean"] == control["controls"]["float32"][
        "mismatch/abs_mean"]


def test_identity_is_recorded_compared_with_the_runs_and_a_different_tree_fails(tmp_path):
    import subprocess

    ident_mod = report_mod._sibling("gpu_check_identity")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    for cmd in (["init", "-q"], ["add", "a.py"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True)
    sent = ident_mod.sending_identity(repo)
    assert sent["dirty"] is False and sent["files"] == 1 and len(sent["tree_digest"]) == 64
    same = ident_mod.verify(sent, repo)
    (repo / "a.py").write_text("x = 2\n")  # the device ran other code
    other = ident_mod.verify(sent, repo)
    assert same["matches"] and not other["matches"]

    out = _check_dir(tmp_path, PASSED)
    run = out / "runs" / "smollm2-add-m2po-cpu" / "real-model-float32"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"code": {"commit": "0" * 40, "dirty": True}}))
    (out / "parts" / "identity.json").write_text(json.dumps(same))
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "300"]) == 0
    data = json.loads((out / report_mod.REPORT).read_text())
    ident = data["summary"]["identity"]
    assert ident["sent_commit"] == sent["commit"] and ident["matches"] and ident["sent_dirty"] is False
    assert ident["runs"] == {"smollm2-add-m2po-cpu/real-model-float32": {"commit": "0" * 40, "dirty": True}}
    assert any("summary.json says commit 000000000000, dirty True" in w for w in data["warnings"])
    assert f"code: sent commit {sent['commit'][:12]}" in report_mod.format_check(data)
    assert other["device_differing"] == ["a.py"]
    (out / "parts" / "identity.json").write_text(json.dumps(other))
    assert report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "300"]) == 1
    assert any("differing: a.py" in p for p in json.loads((out / report_mod.REPORT).read_text())["problems"])
    # CPU dry mode: the "device" is the sending checkout itself, edited meanwhile: a warning
    assert report_mod.main(["assemble", str(out), "--device", "cpu", "--budget", "420", "--elapsed", "300"]) == 0
    (out / "parts" / "identity.json").unlink()  # not sent: a warning that says how
    report_mod.main(["assemble", str(out), "--device", "cuda", "--budget", "420", "--elapsed", "300"])
    assert any("no code identity" in w for w in json.loads((out / report_mod.REPORT).read_text())["warnings"])


def test_the_bench_memory_ratio_is_checked_on_cuda():
    ok = bench_mod.memory_entry(3.6, 36.6)
    assert ok["passed"] and ok["error"] == pytest.approx(0.0984, abs=1e-3)
    assert not bench_mod.memory_entry(20.0, 36.6)["passed"]  # the chunked head saved too little: it fails
    assert not bench_mod.memory_entry(None, 36.6)["passed"]  # not measured on CUDA fails too


def test_the_bench_token_count_is_the_shipped_configs_micro_batch():
    import yaml

    cfg = yaml.safe_load((REPO / "examples/math/gsm8k_m2po.yaml").read_text())
    assert bench_mod.config_tokens() == cfg["actor"]["mb_spec"]["max_tokens_per_mb"] == 8192


def test_m2po_selection_entries_assert_the_floor_ratio_on_cuda_only():
    m2po = report_mod._sibling("gpu_check_m2po")
    raw = [{"n": 1_000_000, "ours": 0.002, "floor": 0.001}, {"n": 8_000_000, "ours_s": 0.04, "floor_s": 0.01}]
    entries, problems = m2po.entries_from({"sizes": raw}, "cuda")
    assert problems == [] and [e["passed"] for e in entries] == [True, False]
    assert entries[1]["error"] == pytest.approx(4.0) and entries[1]["tolerance"] == 3.0
    entries, _ = m2po.entries_from(raw, "cpu")
    assert all(e["passed"] and not e["asserted"] for e in entries)
    assert m2po.entries_from({"x": 1}, "cuda")[1]  # nothing readable is a problem
    # bench/m2po_selection.py --json's records (issue 48): timing records, and its own ratio when it gives one
    rec = {"valid_tokens": 64000, "ours": {"best_s": 0.002, "median_s": 0.003}, "floor": {"best_s": 0.001}}
    (e,) = m2po.entries_from({"sizes": [rec]}, "cuda")[0]
    assert e["error"] == pytest.approx(2.0) and e["tokens"] == 64000 and e["passed"]
    (e,) = m2po.entries_from({"sizes": [dict(rec, ours_over_floor=3.5)]}, "cuda")[0]
    assert e["error"] == 3.5 and not e["passed"]
