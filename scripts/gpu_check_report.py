"""scripts/gpu_check.sh's reports: one run's figures (real_scale, real_model) and the whole check's report.

**A run** (``gpu_check_report.py RUN_DIR --steps N ...``): checks the run's metrics.jsonl (steps 1..N logged, finite
loss and grad norm; a nonzero gradient for the real-scale run, whose shifted rewards always train) and writes its
figures per step: the time split into generation / log-probs / forward+backward / optimizer
(``timing/split/*``, disjoint phases of ``timing/step_s``), evaluation time, generated and trained tokens per second,
response length, staleness, M2PO's masked fraction, the engine-vs-trainer log-prob mismatch (``mismatch/*``); peak
memory over the run (the CUDA allocator's peaks, or peak RSS on CPU; nvidia-smi's sampled peak when there is one).
``--kind real_model`` adds a summary over the steps (tokens/s of the steps after the first, the mismatch over all
probed steps) and requires the mismatch figures; with ``--variant float32`` the float32 engine must agree with the
trainer within :data:`FP32_MISMATCH_TOL` (both sides compute in float32), and with ``--variant bfloat16`` within
``BF16_MISMATCH_MAX`` (scripts/gpu_check_mismatch.py: 4x the largest measured, so a broken engine fails); an exact 0
in bf16 is a warning (the mismatch control beside it says whether the comparison could see a difference).

**The check** (``gpu_check_report.py assemble OUT_DIR --device D --budget S --elapsed S``): merges the parts' files
(``parts.tsv`` written by the shell script: status, seconds, slice and why per part; ``parts/*.json``) into
``OUT_DIR/gpu_check_report.json``, whose ``summary`` holds the verdict and the key figures, and ``skipped`` every
part or measurement that did not run or was cut, each with its reason. Exit code 0 (PASS), 1 (FAIL: a part or a
comparison failed, or a part was killed by a signal before its slice ran out), 3 (INCOMPLETE: nothing failed, but a
part was cut by its time slice, a required part was skipped for the budget, or real_model did not run on CUDA) or 4
(PARTIAL: ``--parts`` chose some parts; every part that ran passed). No verdict is PASS over a part that did not run.

**A part's exit status** (``gpu_check_report.py status RC ELAPSED LIMIT``, what the shell records): 0 pass; ``cut``
only when the part's elapsed time reached its slice (``timeout`` then exits 124, or 137 after its kill); any other
death by a signal is ``fail``, "killed (signal N; OOM?)"; any other exit code ``fail``.

    python scripts/gpu_check_report.py RUN_DIR --steps N --exit-code RC --device cuda|cpu [--kind real_scale|real_model
        --variant V] [--nvidia-smi CSV] [--log LOG] [--bench JSON] --out JSON
    python scripts/gpu_check_report.py assemble OUT_DIR --device cuda|cpu --budget SECONDS --elapsed SECONDS
        [--selected a,b]
    python scripts/gpu_check_report.py status RC ELAPSED LIMIT     # prints "status<TAB>why"
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
VERDICT_EXIT = {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3, "PARTIAL": 4}


def exit_status(rc: int, elapsed: int, limit: int) -> tuple[str, str]:
    """A part's status and why from its exit code, elapsed seconds and slice: ``cut`` only when the slice was
    reached (timeout's 124, or 137 when its -k kill was needed); a signal before that is a kill (the OOM killer's
    SIGKILL is 137 too), a failure. ``elapsed`` is whole seconds from the shell's SECONDS, which can read one short."""
    if rc == 0:
        return "pass", ""
    reached = limit > 0 and elapsed >= limit - 1
    if rc in (124, 137) and reached:
        return "cut", f"its {limit}s slice ran out"
    if rc > 128:
        return "fail", f"killed (signal {rc - 128}; OOM?) after {elapsed}s of its {limit}s slice"
    return "fail", f"exit code {rc}"


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
    report["warnings"] = []
    mm0 = report["mismatch_step0"]
    if kind == "real_scale" and mm0 and "mismatch/abs_mean" in mm0:
        # the 1.5B shape's bf16 engine (HF or vLLM) at step 0: the same bound as the real model's bf16 runs
        bound = _mismatch_module().BF16_MISMATCH_MAX
        if mm0["mismatch/abs_mean"] > bound:
            problems.append(f"bf16 engine mismatch at step 0 mean |d| {mm0['mismatch/abs_mean']:.3g} > {bound:g}")
        report["ok"] = not problems
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
        if variant in ("bfloat16", "vllm") and report["mismatch"] is not None:
            bound = _mismatch_module().BF16_MISMATCH_MAX
            err = report["mismatch"]["abs_mean"]
            report["checks"].append({
                "check": f"real_model/{variant}_engine_mismatch", "dtype": "bfloat16", "quantity": "mismatch/abs_mean",
                "error": err, "tolerance": bound, "comparison": "<=", "passed": err <= bound,
                "rule": "a bf16 engine against the trainer's bf16 autocast pass: 4x the largest mean |d| measured "
                        "(0.024 CPU SmolLM2, 0.0076 H200 Qwen2.5-1.5B shape); a broken engine is far above"})
            if err > bound:
                problems.append(f"bf16 engine mismatch mean |d| {err:.3g} > {bound:g} (a broken engine?)")
            if err == 0.0:
                report["warnings"].append(
                    f"{variant} engine mismatch is exactly 0 on {report['mismatch']['tokens']:.0f} tokens: bit-identical "
                    "engine and trainer log-probs, or a blind probe; see the mismatch control")
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
    lines += [f"  WARNING: {w}" for w in report.get("warnings", [])]
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


def _mismatch_module():
    return _sibling("gpu_check_mismatch")


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


def _run_codes(out_dir: Path) -> dict[str, Any]:
    """Each run's recorded code identity (summary.json's ``code``: the device copy's commit and dirty flag)."""
    codes = {}
    for f in sorted((out_dir / "runs").glob("*/*/summary.json")):
        data = _load(f) or {}
        codes[f"{f.parent.parent.name}/{f.parent.name}"] = {k: (data.get("code") or {}).get(k)
                                                             for k in ("commit", "dirty")}
    return codes


def _part_figures(pdir: Path, name: str, problems: list[str], entries: list[dict[str, Any]],
                  warnings: list[str], by_name: dict[str, dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A part's own JSON (mismatch_control, long, m2po_selection): its entries join the comparisons, its problems
    and warnings the report's; a part that passed without writing it is a problem."""
    data = _load(pdir / f"{name}.json")
    part = name.split("_control")[0] if name == "mismatch_control" else name
    if data is None:
        if by_name.get(part, {}).get("status") == "pass" and name != "mismatch_control":
            problems.append(f"{name}: no parts/{name}.json")
        return None
    entries += data.get("entries", [])
    problems += [f"{name}: {e['check']} [{e['dtype']}] {e['quantity']}: {e['error']:.3g} (tolerance "
                 f"{e['comparison']} {e['tolerance']:.3g})" for e in data.get("entries", []) if not e.get("passed")]
    problems += [f"{name}: {p}" for p in data.get("problems", [])]
    warnings += [f"{name}: {w}" for w in data.get("warnings", [])]
    return data


def verdict_of(parts: list[dict[str, Any]], problems: list[str], *, device: str,
               selected: str = "") -> tuple[str, list[str]]:
    """FAIL > INCOMPLETE > PARTIAL > PASS, and the parts that make it INCOMPLETE.

    INCOMPLETE: a part cut by its slice; a part the check should run skipped for the budget ("budget:"; an optional
    part's skip says "budget (optional part):"); on CUDA, real_model not run for any reason but --parts (its
    figures are what a GPU slot is for: a missing GGUF must not pass). PARTIAL: --parts chose some parts."""
    incomplete = [p["name"] for p in parts
                  if p["status"] == "cut" or (p["status"] == "skipped" and p["why"].startswith("budget:"))]
    if device == "cuda":
        incomplete += [p["name"] for p in parts if p["name"] == "real_model" and p["status"] == "skipped"
                       and not p["why"].startswith("not selected") and p["name"] not in incomplete]
    partial = bool(selected) or any(p["status"] == "skipped" and p["why"].startswith("not selected") for p in parts)
    if problems:
        return "FAIL", incomplete
    if incomplete:
        return "INCOMPLETE", incomplete
    return ("PARTIAL" if partial else "PASS"), incomplete


def assemble(out_dir: Path, *, device: str, budget: int, elapsed: int, selected: str = "") -> dict[str, Any]:
    parts = read_parts(out_dir / "parts.tsv")
    pdir = out_dir / "parts"
    by_name = {p["name"]: p for p in parts}
    report: dict[str, Any] = {"device": device, "budget_s": budget, "elapsed_s": elapsed, "out_dir": str(out_dir),
                              "selected": selected or None, "parts": parts,
                              "environment": _load(pdir / "environment.json"), "wheels": _load(pdir / "wheels.json")}
    problems: list[str] = []
    warnings: list[str] = []
    skipped: list[dict[str, str]] = []
    for p in parts:
        if p["status"] == "skipped":
            skipped.append({"what": p["name"], "why": p["why"] or "not said"})
        elif p["status"] == "cut" and p["limit_s"] and p["seconds"] < p["limit_s"] - 1:
            # the shell classifies with exit_status; a "cut" before the slice ran out is a kill, whoever wrote it
            problems.append(f"{p['name']} failed: killed after {p['seconds']}s of its {p['limit_s']}s slice, "
                            f"recorded as cut ({p['why'] or 'no reason'})")
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
        if by_name.get(f"real_model/{run.get('variant')}", {}).get("status") != "cut":
            problems += [f"real_model/{run.get('variant')}: {p}" for p in run["problems"]]
        warnings += [f"real_model/{run.get('variant')}: {w}" for w in run.get("warnings", [])]
    report["real_model"] = real_model
    report["mismatch_control"] = _part_figures(pdir, "mismatch_control", problems, entries, warnings, by_name)
    real_scale = _load(pdir / "real_scale.json")
    report["real_scale"] = real_scale
    if real_scale is not None and by_name.get("real_scale", {}).get("status") != "cut":
        problems += [f"real_scale: {p}" for p in real_scale["problems"]]
    report["long"] = _part_figures(pdir, "long", problems, entries, warnings, by_name)
    bench = _load(pdir / "bench.json")
    report["bench"] = bench
    if bench is not None:
        problems += _bench_module().bench_problems(bench)
        skipped += _bench_skips(bench)
        entries += [e for e in (bench.get("logprob") or {}).get("entries", [])]
    elif by_name.get("bench", {}).get("status") == "pass":
        problems.append("bench: no parts/bench.json")
    report["m2po_selection"] = _part_figures(pdir, "m2po_selection", problems, entries, warnings, by_name)
    if (report["m2po_selection"] or {}).get("run") is False:
        skipped.append({"what": "m2po_selection", "why": report["m2po_selection"].get("why") or "not said"})
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

    # the code that ran: what the sending side recorded, whether this copy's tree equals it, what the runs say
    identity = _load(pdir / "identity.json")
    report["identity"] = identity
    run_codes = _run_codes(out_dir)
    report["run_codes"] = run_codes
    if identity is None or identity.get("sent") is None:
        warnings.append("no code identity: " + ((identity or {}).get("why") or "parts/identity.json is missing")
                        + "; the runs' summary.json say " + (", ".join(
                            f"{r} {str(c.get('commit'))[:12]} dirty {c.get('dirty')}" for r, c in run_codes.items())
                            or "nothing"))
    else:
        if not identity.get("matches"):
            # on a GPU machine the evidence would not be of the code sent: a failure; in CPU dry mode the "device"
            # is the sending checkout itself, edited meanwhile: said, not failed
            (problems if device == "cuda" else warnings).append(
                f"identity: this copy's tree digest {identity.get('device_tree_digest', '')[:16]} is not the sent "
                f"{identity['sent'].get('tree_digest', '')[:16]} (differing: "
                f"{', '.join((identity.get('device_differing') or [])[:10]) or 'not listed'}; missing here: "
                f"{len(identity.get('device_missing') or [])}): the evidence is not of the code sent")
        warnings += _sibling("gpu_check_identity").compare_with_runs(identity, run_codes)

    verdict, incomplete = verdict_of(parts, problems, device=device, selected=selected)
    n_failed = sum(1 for e in entries if not e.get("passed"))
    report["problems"] = problems
    report["warnings"] = warnings
    report["skipped"] = skipped
    report["ok"] = verdict == "PASS"
    sent = (identity or {}).get("sent") or {}
    report["summary"] = {
        "verdict": verdict, "device": device, "budget_s": budget, "elapsed_s": elapsed,
        "within_budget": elapsed <= budget, "incomplete": incomplete, "selected": selected or None,
        "parts": {p["name"]: p["status"] for p in parts if "/" not in p["name"]},
        "seconds": {p["name"]: p["seconds"] for p in parts if p["status"] != "skipped"},
        "numerics": {"checks": len(entries), "passed": len(entries) - n_failed, "failed": n_failed},
        "identity": {"sent_commit": sent.get("commit"), "sent_dirty": sent.get("dirty"),
                     "sent_tree_digest": sent.get("tree_digest"),
                     "device_tree_digest": (identity or {}).get("device_tree_digest"),
                     "matches": (identity or {}).get("matches"), "runs": run_codes},
        "real_model": {v: {**(r.get("summary") or {}), "mismatch": r.get("mismatch"), "ok": r.get("ok")}
                       for v, r in real_model.items()},
        "mismatch_control": ({"engine_vs_trainer": report["mismatch_control"].get("engine_vs_trainer"),
                              "controls": report["mismatch_control"].get("controls"),
                              "tokens_file": report["mismatch_control"].get("tokens_file")}
                             if report["mismatch_control"] else None),
        "real_scale": ({**(real_scale.get("summary") or {}), "ok": real_scale.get("ok"),
                        "mismatch_step0_abs_mean": (real_scale.get("mismatch_step0") or {}).get("mismatch/abs_mean")}
                       if real_scale else None),
        "long": [{k: r.get(k) for k in ("tokens_per_row", "rows", "step_s", "peak_allocated_gib", "ok")}
                 for r in (report["long"] or {}).get("runs", [])] or None,
        "skipped": [f"{s['what']}: {s['why']}" for s in skipped],
        "warnings": warnings,
        "problems": problems,
    }
    return report


def _fmt(value: Any, spec: str = ".4g") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def format_check(report: dict[str, Any]) -> str:
    s = report["summary"]
    title = s["verdict"] + (f" (--parts {s['selected']})" if s.get("selected") else "")
    lines = [f"==================== stalerl GPU check ({s['device']}): {title}, {s['elapsed_s']}s of "
             f"{s['budget_s']}s ====================",
             "  parts: " + ", ".join(f"{k} {v} ({s['seconds'].get(k, 0)}s)" for k, v in s["parts"].items())]
    ident = s.get("identity") or {}
    if ident.get("sent_commit"):
        lines.append(f"  code: sent commit {ident['sent_commit'][:12]}, dirty {ident['sent_dirty']}, tree "
                     f"{ident['sent_tree_digest'][:16]}; ran tree {str(ident.get('device_tree_digest'))[:16]} "
                     f"({'matches' if ident.get('matches') else 'DIFFERS'})")
    n = s["numerics"]
    lines.append(f"  comparisons: {n['passed']}/{n['checks']} within their stated tolerance" if n["checks"]
                 else "  comparisons: none ran")
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
    if report.get("mismatch_control"):
        lines += ["  " + ln for ln in _mismatch_module().format_control(report["mismatch_control"])
                  if not ln.lstrip().startswith("WARNING")]
    rs = s.get("real_scale")
    if rs:
        lines.append(f"  real scale: step {_fmt(rs.get('step_s'))} s (generation {_fmt(rs.get('generation_s'))}, "
                     f"log-probs {_fmt(rs.get('logp_s'))}, fwd+bwd {_fmt(rs.get('forward_backward_s'))}, optimizer "
                     f"{_fmt(rs.get('optimizer_s'))}), generation {_fmt(rs.get('gen_tokens_per_s'))} tok/s, peak "
                     f"{_fmt(rs.get('peak_memory_gib'), '.3g')} GiB")
    for r in s.get("long") or []:
        lines.append(f"  long rows: {r.get('rows')} x {r.get('tokens_per_row')} tokens, one step "
                     f"{_fmt(r.get('step_s'))} s, peak allocated {_fmt(r.get('peak_allocated_gib'), '.3g')} GiB"
                     f"{'' if r.get('ok') else ' FAILED'}")
    if report.get("bench"):
        lines += _bench_module().format_bench(report["bench"])
    for e in (report.get("m2po_selection") or {}).get("entries", []):
        lines.append(f"  m2po selection {e['quantity']}: {e['error']:.3g} {e['comparison']} {e['tolerance']:.3g}"
                     f"{'' if e['passed'] else ' FAILED'}")
    for ln in report.get("smoke") or []:
        lines.append(f"  smoke: {ln}")
    lines += [f"  skipped: {x}" for x in s["skipped"]]
    lines += [f"  WARNING: {x}" for x in s.get("warnings", [])]
    lines += [f"  problem: {x}" for x in s["problems"]]
    return "\n".join(lines)


def assemble_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check_report.py assemble", description="the whole check's report")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--elapsed", type=int, required=True)
    ap.add_argument("--selected", default="", help="--parts' list (the verdict is then PARTIAL at best)")
    args = ap.parse_args(argv)
    report = assemble(args.out_dir, device=args.device, budget=args.budget, elapsed=args.elapsed,
                      selected=args.selected)
    write_json_atomic(args.out_dir / REPORT, report)
    print(format_check(report))
    return VERDICT_EXIT[report["summary"]["verdict"]]


def status_main(argv: list[str]) -> int:
    rc, elapsed, limit = (int(x) for x in argv)
    status, why = exit_status(rc, elapsed, limit)
    print(f"{status}\t{why}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["assemble"]:
        return assemble_main(argv[1:])
    if argv[:1] == ["status"]:
        return status_main(argv[1:])
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
