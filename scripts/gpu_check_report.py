"""scripts/gpu_check.sh's reports: one run's figures (real_scale, real_model) and the whole check's report.

**A run** (``gpu_check_report.py RUN_DIR --steps N ...``): checks the run's metrics.jsonl (steps 1..N logged, finite
loss and grad norm; a nonzero gradient for the real-scale run, whose shifted rewards always train) and writes its
figures per step: the time split into generation / log-probs / forward+backward / optimizer
(``timing/split/*``, disjoint phases of ``timing/step_s``), evaluation time, generated and trained tokens per second,
response length, staleness, M2PO's masked fraction, the engine-vs-trainer log-prob mismatch (``mismatch/*``); peak
memory over the run (the CUDA allocator's peaks, or peak RSS on CPU; nvidia-smi's sampled peak when there is one).
``--kind real_model`` adds a summary over the steps (tokens/s of the steps after the first, the mismatch over all
probed steps) and requires the mismatch figures; with ``--variant float32`` the float32 engine must agree with the
trainer within :data:`FP32_MISMATCH_TOL` (both sides compute in float32).

**The check** (``gpu_check_report.py assemble OUT_DIR --device D --budget S --elapsed S``): merges the parts' files
(``parts.tsv`` written by the shell script: status, seconds, slice and why per part; ``parts/*.json``) into
``OUT_DIR/gpu_check_report.json``, whose ``summary`` holds the verdict and the key figures, and ``skipped`` every
part or measurement that did not run or was cut, each with its reason. Exit code 0 (PASS), 1 (FAIL: a part or a
comparison failed) or 3 (INCOMPLETE: nothing failed, but a part was cut by its time slice or a required part was
skipped for the budget).

    python scripts/gpu_check_report.py RUN_DIR --steps N --exit-code RC --device cuda|cpu [--kind real_scale|real_model
        --variant V] [--nvidia-smi CSV] [--log LOG] [--bench JSON] --out JSON
    python scripts/gpu_check_report.py assemble OUT_DIR --device cuda|cpu --budget SECONDS --elapsed SECONDS
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

STEP_KEYS = {  # report name: metrics.jsonl key
    "step_s": "timing/step_s",
    "generation_s": "timing/split/generation_s",
    "logp_s": "timing/split/logp_s",
    "training_s": "timing/split/training_s",
    "forward_backward_s": "timing/split/forward_backward_s",
    "optimizer_s": "timing/split/optimizer_s",
    "eval_s": "timing/eval_s",
    "gen_tokens_per_s": "throughput/gen_tokens_per_s",
    "train_tokens_per_s": "throughput/train_tokens_per_s",
    "response_length": "response_length",
    "reward": "reward",
    "eval_accuracy": "eval/accuracy",
    "staleness_avg": "staleness/avg",
    "m2po_masked_fraction": "actor/m2po/masked_fraction",
    "micro_batches": "actor/num_micro_batches",
    "chunked_logprobs": "actor/chunked_logprobs",
    "loss": "actor/loss",
    "grad_norm": "actor/grad_norm",
    # engine mismatch on fresh data (stats_logger.mismatch_freq_steps; the probe at step 0 lands in step 1's row)
    "mismatch_abs_mean": "mismatch/abs_mean",
    "mismatch_m2": "mismatch/m2",
    "weight_sync_s": "timing/weight_sync_s",  # vLLM engines only (part of generation_s)
}
MISMATCH_KEYS = ("mismatch/abs_mean", "mismatch/abs_p99", "mismatch/max_abs", "mismatch/frac_gt_0.1",
                 "mismatch/mean", "mismatch/m2", "mismatch/tokens")
PEAK_KEYS = ("memory/gpu_peak_allocated_gib", "memory/gpu_peak_reserved_gib", "memory/peak_rss_gib")
# A float32 HF engine (KV-cache generation) against the trainer's float32 forward: the same computation up to the
# order of float32 sums (~2e-6 mean |d| measured on CPU for SmolLM2; TF32, which torch leaves off, would be ~1e-3).
FP32_MISMATCH_TOL = 1e-4
REPORT = "gpu_check_report.json"


def check_rows(rows: list[dict[str, Any]], steps: int, *, require_gradient: bool = True) -> list[str]:
    """Problems with the logged steps (empty: the run trained every step)."""
    problems = []
    got = [r["step"] for r in rows if r.get("step", 0) > 0]
    if got != list(range(1, steps + 1)):
        problems.append(f"logged steps {got}, expected 1..{steps}")
    for r in rows:
        if r.get("step", 0) <= 0:
            continue
        for key in ("actor/loss", "actor/grad_norm", "timing/split/generation_s", "timing/split/logp_s",
                    "timing/split/training_s"):
            value = r.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"step {r['step']}: {key} = {value!r}")
        if require_gradient and not r.get("actor/grad_norm", 0) > 0:
            problems.append(f"step {r['step']}: zero gradient, nothing was trained")
    return problems


def nvidia_smi_peak_mib(path: Optional[Path]) -> Optional[float]:
    if path is None or not path.is_file():
        return None
    values = []
    for line in path.read_text().splitlines():
        try:
            values.append(float(line.split(",")[0]))
        except ValueError:
            continue
    return max(values) if values else None


def weight_sync_path(log_text: Optional[str]) -> str:
    """The weight-sync path the run's log names ("vLLM weight sync: <path> (<why>)"), else what an HF engine does."""
    import re

    m = re.search(r"vLLM weight sync: (\S+) \(([^)]*)\)", log_text or "")
    if m:
        return f"{m.group(1)} ({m.group(2)})"
    return "none: the HF engine generates with the trainer's own module"


def _mean(values: list[float]) -> Optional[float]:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def mismatch_summary(rows: list[dict[str, Any]]) -> Optional[dict[str, float]]:
    """The engine mismatch over every probed step: token-weighted means of the means, the max of the maxima."""
    probed = [r for r in rows if r.get("step", 0) > 0 and r.get("mismatch/tokens")]
    if not probed:
        return None
    n = sum(r["mismatch/tokens"] for r in probed)
    out = {"steps": len(probed), "tokens": n}
    for key in ("abs_mean", "m2", "mean", "frac_gt_0.1"):
        out[key] = sum(r.get(f"mismatch/{key}", 0.0) * r["mismatch/tokens"] for r in probed) / n
    out["abs_p99"] = max(r.get("mismatch/abs_p99", 0.0) for r in probed)  # the worst step's 99th percentile
    out["max_abs"] = max(r.get("mismatch/max_abs", 0.0) for r in probed)
    return out


def run_summary(per_step: list[dict[str, Any]], peaks: dict[str, float]) -> dict[str, Any]:
    """Key figures of a run: tokens/s and step split of the steps after the first (CUDA start-up and allocator
    warm-up land in step 1), or of step 1 when it is the only one."""
    steady = per_step[1:] or per_step
    out = {name: _mean([s.get(name) for s in steady]) for name in (
        "gen_tokens_per_s", "train_tokens_per_s", "step_s", "generation_s", "logp_s", "forward_backward_s",
        "optimizer_s")}
    out["eval_s"] = _mean([s.get("eval_s") for s in per_step])
    out["steps_in_means"] = [s["step"] for s in steady]
    out["peak_memory_gib"] = max(peaks.values()) if peaks else None
    return out


def build_report(rows: list[dict[str, Any]], *, steps: int, exit_code: int, device: str,
                 smi_peak_mib: Optional[float], log_text: Optional[str] = None, kind: str = "real_scale",
                 variant: Optional[str] = None) -> dict[str, Any]:
    trained = [r for r in rows if r.get("step", 0) > 0]
    per_step = [{"step": r["step"], **{name: r.get(key) for name, key in STEP_KEYS.items()}} for r in trained]
    peaks = {key.split("/", 1)[1]: max((r[key] for r in trained if key in r), default=None) for key in PEAK_KEYS}
    peaks = {k: v for k, v in peaks.items() if v is not None}
    problems = ([f"run exited with code {exit_code}"] if exit_code else []) + check_rows(
        rows, steps, require_gradient=kind == "real_scale")
    report = {"kind": kind, "device": device, "steps": steps, "ok": not problems, "problems": problems,
              "per_step": per_step, "peak_memory_gib": peaks, "nvidia_smi_peak_mib": smi_peak_mib,
              "weight_sync_path": weight_sync_path(log_text),
              "mismatch_step0": next(({k: r[k] for k in r if k.startswith("mismatch/")} for r in trained
                                      if "mismatch/m2" in r), None),
              "summary": run_summary(per_step, peaks) if per_step else None}
    if kind == "real_model":
        report["variant"] = variant
        report["mismatch"] = mismatch_summary(rows)
        report["checks"] = []
        if trained and report["mismatch"] is None:
            problems.append("no mismatch/* figures logged (stats_logger.mismatch_freq_steps=1 probes every step)")
        if variant == "float32" and report["mismatch"] is not None:
            err = report["mismatch"]["abs_mean"]
            report["checks"].append({
                "check": "real_model/fp32_engine_mismatch", "dtype": "float32", "quantity": "mismatch/abs_mean",
                "error": err, "tolerance": FP32_MISMATCH_TOL, "comparison": "<=", "passed": err <= FP32_MISMATCH_TOL,
                "rule": "a float32 HF engine (KV-cache generation) and the trainer's float32 forward compute the same "
                        "log-probs up to the order of float32 sums"})
            if err > FP32_MISMATCH_TOL:
                problems.append(f"float32 engine mismatch mean |d| {err:.3g} > {FP32_MISMATCH_TOL:g}")
        report["ok"] = not problems
    return report


def format_report(report: dict[str, Any]) -> str:
    name = report.get("kind", "real_scale").replace("_", "-")
    if report.get("variant"):
        name += f" ({report['variant']})"
    lines = [f"{name} run ({report['device']}): {'PASS' if report['ok'] else 'FAIL'}"]
    lines += [f"  problem: {p}" for p in report["problems"]]
    header = ("step", "step_s", "generation_s", "logp_s", "fwd_bwd_s", "optim_s", "gen_tok/s", "train_tok/s",
              "resp_len", "stale", "masked")
    lines.append("  " + " ".join(f"{h:>11}" for h in header))
    for s in report["per_step"]:
        cells = (s["step"], s["step_s"], s["generation_s"], s["logp_s"], s.get("forward_backward_s"),
                 s.get("optimizer_s"), s["gen_tokens_per_s"], s.get("train_tokens_per_s"), s["response_length"],
                 s["staleness_avg"], s["m2po_masked_fraction"])
        lines.append("  " + " ".join(f"{c:>11.4g}" if isinstance(c, (int, float)) else f"{'-':>11}" for c in cells))
    peaks = ", ".join(f"{k} {v:.2f} GiB" for k, v in report["peak_memory_gib"].items()) or "not logged"
    lines.append(f"  peak memory: {peaks}")
    if report.get("kind", "real_scale") == "real_scale":
        lines.append(f"  weight sync: {report.get('weight_sync_path')}")
        mm = report.get("mismatch_step0")
        lines.append("  engine mismatch at step 0 (trainer - engine log-prob on fresh data): "
                     + (f"mean |d| {mm['mismatch/abs_mean']:.3g}, M2 {mm['mismatch/m2']:.3g}, max |d| "
                        f"{mm['mismatch/max_abs']:.3g} over {mm['mismatch/tokens']:.0f} tokens"
                        if mm else "not logged"))
    mm = report.get("mismatch")
    if mm:
        lines.append(f"  engine mismatch over {mm['steps']} steps, {mm['tokens']:.0f} tokens: mean |d| "
                     f"{mm['abs_mean']:.3g}, p99 |d| {mm['abs_p99']:.3g}, max |d| {mm['max_abs']:.3g}, share |d| > 0.1 "
                     f"{mm['frac_gt_0.1']:.3g}, mean d {mm['mean']:.3g}, M2 {mm['m2']:.3g}")
    if report["nvidia_smi_peak_mib"] is not None:
        lines.append(f"  nvidia-smi peak memory.used: {report['nvidia_smi_peak_mib'] / 1024:.2f} GiB")
    if report.get("bench") is not None:
        lines.append("measurements (scripts/gpu_check_bench.py):")
        lines += _bench_module().format_bench(report["bench"])
    return "\n".join(lines)


def _sibling(name: str):
    """A script beside this file (they run as scripts, not as an installed package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_module():
    return _sibling("gpu_check_bench")


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the report from whoever fetches $OUT
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ the check
def read_parts(path: Path) -> list[dict[str, Any]]:
    """parts.tsv: name, status (pass / fail / cut / skipped), seconds, slice, why."""
    parts = []
    if not path.is_file():
        return parts
    for line in path.read_text().splitlines():
        cells = (line.split("\t") + [""] * 5)[:5]
        if not cells[0]:
            continue
        parts.append({"name": cells[0], "status": cells[1], "seconds": int(cells[2] or 0),
                      "limit_s": int(cells[3] or 0), "why": cells[4].strip()})
    return parts


def _load(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _bench_skips(bench: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for name, part in (bench or {}).items():
        if isinstance(part, dict) and part.get("run") is False:
            out.append({"what": f"bench/{name}", "why": part.get("why") or "not measured"})
    return out


def assemble(out_dir: Path, *, device: str, budget: int, elapsed: int) -> dict[str, Any]:
    parts = read_parts(out_dir / "parts.tsv")
    pdir = out_dir / "parts"
    by_name = {p["name"]: p for p in parts}
    report: dict[str, Any] = {"device": device, "budget_s": budget, "elapsed_s": elapsed, "out_dir": str(out_dir),
                              "parts": parts, "environment": _load(pdir / "environment.json"),
                              "wheels": _load(pdir / "wheels.json")}
    problems: list[str] = []
    skipped: list[dict[str, str]] = []
    for p in parts:
        if p["status"] == "skipped":
            skipped.append({"what": p["name"], "why": p["why"] or "not said"})
        elif p["status"] == "cut":
            skipped.append({"what": p["name"], "why": f"cut after {p['seconds']}s: "
                                                      f"{p['why'] or 'its time slice ran out'}"})
        elif p["status"] == "fail":
            problems.append(f"{p['name']} failed" + (f": {p['why']}" if p["why"] else ""))

    numerics = _load(pdir / "numerics.json")
    report["numerics"] = numerics
    entries = list((numerics or {}).get("entries", []))
    if numerics is not None:
        problems += [f"numerics: {f}" for f in numerics["summary"]["failed"] + numerics["summary"]["errors"]]
    elif by_name.get("numerics", {}).get("status") == "pass":
        problems.append("numerics: no parts/numerics.json")

    real_model = {}
    for f in sorted(pdir.glob("real_model_*.json")):
        run = _load(f)
        if run is None:
            continue
        real_model[run.get("variant") or f.stem.split("_", 2)[-1]] = run
        entries += run.get("checks", [])
        problems += [f"real_model/{run.get('variant')}: {p}" for p in run["problems"]
                     if by_name.get(f"real_model/{run.get('variant')}", {}).get("status") != "cut"]
    report["real_model"] = real_model
    real_scale = _load(pdir / "real_scale.json")
    report["real_scale"] = real_scale
    if real_scale is not None and by_name.get("real_scale", {}).get("status") != "cut":
        problems += [f"real_scale: {p}" for p in real_scale["problems"]]
    bench = _load(pdir / "bench.json")
    report["bench"] = bench
    if bench is not None:
        problems += _bench_module().bench_problems(bench)
        skipped += _bench_skips(bench)
    elif by_name.get("bench", {}).get("status") == "pass":
        problems.append("bench: no parts/bench.json")
    smoke_log = out_dir / "logs" / "smoke.log"
    if smoke_log.is_file():
        lines = [ln[len("smoke: "):] for ln in smoke_log.read_text(errors="replace").splitlines()
                 if ln.startswith(("smoke: PASS", "smoke: FAIL", "smoke: SKIP"))]
        report["smoke"] = lines
        for ln in lines:
            if ln.startswith("SKIP "):
                name, _, why = ln[5:].partition(": ")
                skipped.append({"what": f"smoke/{name}", "why": why})
    else:
        report["smoke"] = None

    # INCOMPLETE: a part was cut by its slice, or a part the check should run was skipped for the budget ("budget:";
    # an optional part's skip says "budget (optional part):", a part that does not apply here names its reason)
    incomplete = [p["name"] for p in parts
                  if p["status"] == "cut" or (p["status"] == "skipped" and p["why"].startswith("budget:"))]
    verdict = "FAIL" if problems else ("INCOMPLETE" if incomplete else "PASS")
    n_failed = sum(1 for e in entries if not e.get("passed"))
    report["problems"] = problems
    report["skipped"] = skipped
    report["ok"] = verdict == "PASS"
    report["summary"] = {
        "verdict": verdict, "device": device, "budget_s": budget, "elapsed_s": elapsed,
        "within_budget": elapsed <= budget, "incomplete": incomplete,
        "parts": {p["name"]: p["status"] for p in parts if "/" not in p["name"]},
        "seconds": {p["name"]: p["seconds"] for p in parts if p["status"] != "skipped"},
        "numerics": {"checks": len(entries), "passed": len(entries) - n_failed, "failed": n_failed},
        "real_model": {v: {**(r.get("summary") or {}), "mismatch": r.get("mismatch"), "ok": r.get("ok")}
                       for v, r in real_model.items()},
        "real_scale": ({**(real_scale.get("summary") or {}), "ok": real_scale.get("ok"),
                        "mismatch_step0_abs_mean": (real_scale.get("mismatch_step0") or {}).get("mismatch/abs_mean")}
                       if real_scale else None),
        "skipped": [f"{s['what']}: {s['why']}" for s in skipped],
        "problems": problems,
    }
    return report


def _fmt(value: Any, spec: str = ".4g") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def format_check(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"==================== stalerl GPU check ({s['device']}): {s['verdict']}, {s['elapsed_s']}s of "
             f"{s['budget_s']}s ====================",
             "  parts: " + ", ".join(f"{k} {v} ({s['seconds'].get(k, 0)}s)" for k, v in s["parts"].items())]
    n = s["numerics"]
    lines.append(f"  numerics: {n['passed']}/{n['checks']} within their stated tolerance")
    for e in (report.get("numerics") or {}).get("entries", []):
        if not e["passed"]:
            lines.append(f"    FAIL {e['check']} [{e['dtype']}] {e['quantity']}: {e['error']:.3g} "
                         f"{e['comparison']} {e['tolerance']:.3g}")
    for v, r in s["real_model"].items():
        mm = r.get("mismatch") or {}
        lines.append(f"  real model {v}: generation {_fmt(r.get('gen_tokens_per_s'))} tok/s, training "
                     f"{_fmt(r.get('train_tokens_per_s'))} tok/s, step {_fmt(r.get('step_s'))} s, peak "
                     f"{_fmt(r.get('peak_memory_gib'), '.3g')} GiB; mismatch mean |d| {_fmt(mm.get('abs_mean'), '.3g')}"
                     f", p99 {_fmt(mm.get('abs_p99'), '.3g')}, max {_fmt(mm.get('max_abs'), '.3g')}, share > 0.1 "
                     f"{_fmt(mm.get('frac_gt_0.1'), '.3g')}")
    rs = s.get("real_scale")
    if rs:
        lines.append(f"  real scale: step {_fmt(rs.get('step_s'))} s (generation {_fmt(rs.get('generation_s'))}, "
                     f"log-probs {_fmt(rs.get('logp_s'))}, fwd+bwd {_fmt(rs.get('forward_backward_s'))}, optimizer "
                     f"{_fmt(rs.get('optimizer_s'))}), generation {_fmt(rs.get('gen_tokens_per_s'))} tok/s, peak "
                     f"{_fmt(rs.get('peak_memory_gib'), '.3g')} GiB")
    if report.get("bench"):
        lines += _bench_module().format_bench(report["bench"])
    for ln in report.get("smoke") or []:
        lines.append(f"  smoke: {ln}")
    lines += [f"  skipped: {x}" for x in s["skipped"]]
    lines += [f"  problem: {x}" for x in s["problems"]]
    return "\n".join(lines)


def assemble_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check_report.py assemble", description="the whole check's report")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--elapsed", type=int, required=True)
    args = ap.parse_args(argv)
    report = assemble(args.out_dir, device=args.device, budget=args.budget, elapsed=args.elapsed)
    write_json_atomic(args.out_dir / REPORT, report)
    print(format_check(report))
    return {"PASS": 0, "INCOMPLETE": 3}.get(report["summary"]["verdict"], 1)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["assemble"]:
        return assemble_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kind", choices=("real_scale", "real_model"), default="real_scale")
    ap.add_argument("--variant", default=None, help="real_model: the engine (bfloat16, float32, vllm)")
    ap.add_argument("--nvidia-smi", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log", type=Path, default=None, help="the run's console log (names the weight-sync path)")
    ap.add_argument("--bench", type=Path, default=None, help="scripts/gpu_check_bench.py's JSON")
    args = ap.parse_args(argv)
    metrics = args.run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    report = build_report(rows, steps=args.steps, exit_code=args.exit_code, device=args.device,
                          smi_peak_mib=nvidia_smi_peak_mib(args.nvidia_smi),
                          log_text=args.log.read_text(errors="replace") if args.log and args.log.is_file() else None,
                          kind=args.kind, variant=args.variant)
    if not rows:
        report["problems"].append(f"no metrics at {metrics}")
        report["ok"] = False
    if args.bench is not None:
        if args.bench.is_file():
            report["bench"] = json.loads(args.bench.read_text())
            report["problems"] += _bench_module().bench_problems(report["bench"])
            report["ok"] = not report["problems"]
        else:  # the measurements crashed or ran past their limit: a problem of the check, named
            report["bench"] = None
            report["problems"].append(f"no measurements at {args.bench} (scripts/gpu_check_bench.py failed)")
            report["ok"] = False
    write_json_atomic(args.out, report)
    print(format_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
