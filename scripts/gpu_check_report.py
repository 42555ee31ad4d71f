"""The real-scale part of scripts/gpu_check.sh: checks a run's metrics.jsonl and prints / writes its figures.

Checks: steps 1..N logged, finite loss and grad norm, a nonzero gradient (something was trained). Figures per step:
time split into generation / log-probs / training (``timing/split/*``, disjoint phases of ``timing/step_s``),
generated tokens per second, response length, staleness, M2PO's masked fraction; peak memory over the run (the
CUDA allocator's allocated and reserved peaks, or peak RSS on CPU; nvidia-smi's sampled peak when there is one).

With ``--bench JSON`` (scripts/gpu_check_bench.py's output) the report also carries, under ``bench``, the
chunked-vs-plain log-prob time, vLLM's generation tokens/s with and without CUDA graphs and the weight-sync path and
time per sync (colocated, and nccl to a worker on another GPU), each either measured or skipped with the reason.

    python scripts/gpu_check_report.py RUN_DIR --steps N --exit-code RC --device cuda|cpu [--nvidia-smi CSV]
        [--bench JSON] --out JSON
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
    "gen_tokens_per_s": "throughput/gen_tokens_per_s",
    "train_tokens_per_s": "throughput/train_tokens_per_s",
    "response_length": "response_length",
    "staleness_avg": "staleness/avg",
    "m2po_masked_fraction": "actor/m2po/masked_fraction",
    "micro_batches": "actor/num_micro_batches",
    "loss": "actor/loss",
    "grad_norm": "actor/grad_norm",
    # engine mismatch on fresh data (stats_logger.mismatch_freq_steps; the probe at step 0 lands in step 1's row)
    "mismatch_abs_mean": "mismatch/abs_mean",
    "mismatch_m2": "mismatch/m2",
    "weight_sync_s": "timing/weight_sync_s",  # vLLM engines only (part of generation_s)
}
PEAK_KEYS = ("memory/gpu_peak_allocated_gib", "memory/gpu_peak_reserved_gib", "memory/peak_rss_gib")


def check_rows(rows: list[dict[str, Any]], steps: int) -> list[str]:
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
        if not r.get("actor/grad_norm", 0) > 0:
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


def build_report(rows: list[dict[str, Any]], *, steps: int, exit_code: int, device: str,
                 smi_peak_mib: Optional[float], log_text: Optional[str] = None) -> dict[str, Any]:
    trained = [r for r in rows if r.get("step", 0) > 0]
    per_step = [{"step": r["step"], **{name: r.get(key) for name, key in STEP_KEYS.items()}} for r in trained]
    peaks = {key.split("/", 1)[1]: max((r[key] for r in trained if key in r), default=None) for key in PEAK_KEYS}
    problems = ([f"run exited with code {exit_code}"] if exit_code else []) + check_rows(rows, steps)
    return {"device": device, "steps": steps, "ok": not problems, "problems": problems, "per_step": per_step,
            "peak_memory_gib": {k: v for k, v in peaks.items() if v is not None},
            "nvidia_smi_peak_mib": smi_peak_mib, "weight_sync_path": weight_sync_path(log_text),
            "mismatch_step0": next(({k: r[k] for k in r if k.startswith("mismatch/")} for r in trained
                                    if "mismatch/m2" in r), None)}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"real-scale run ({report['device']}): {'PASS' if report['ok'] else 'FAIL'}"]
    lines += [f"  problem: {p}" for p in report["problems"]]
    header = ("step", "step_s", "generation_s", "logp_s", "training_s", "gen_tok/s", "resp_len", "stale",
              "masked")
    lines.append("  " + "  ".join(f"{h:>12}" for h in header))
    for s in report["per_step"]:
        cells = (s["step"], s["step_s"], s["generation_s"], s["logp_s"], s["training_s"], s["gen_tokens_per_s"],
                 s["response_length"], s["staleness_avg"], s["m2po_masked_fraction"])
        lines.append("  " + "  ".join(f"{c:>12.4g}" if isinstance(c, (int, float)) else f"{'-':>12}" for c in cells))
    peaks = ", ".join(f"{k} {v:.2f} GiB" for k, v in report["peak_memory_gib"].items()) or "not logged"
    lines.append(f"  peak memory: {peaks}")
    lines.append(f"  weight sync: {report.get('weight_sync_path')}")
    mm = report.get("mismatch_step0")
    lines.append("  engine mismatch at step 0 (trainer - engine log-prob on fresh data): "
                 + (f"mean |d| {mm['mismatch/abs_mean']:.3g}, M2 {mm['mismatch/m2']:.3g}, max |d| "
                    f"{mm['mismatch/max_abs']:.3g} over {mm['mismatch/tokens']:.0f} tokens" if mm else "not logged"))
    if report["nvidia_smi_peak_mib"] is not None:
        lines.append(f"  nvidia-smi peak memory.used: {report['nvidia_smi_peak_mib'] / 1024:.2f} GiB")
    if report.get("bench") is not None:
        lines.append("measurements (scripts/gpu_check_bench.py):")
        lines += _bench_module().format_bench(report["bench"])
    return "\n".join(lines)


def _bench_module():
    """scripts/gpu_check_bench.py, beside this file (both run as scripts, not as an installed package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_bench", Path(__file__).with_name("gpu_check_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nvidia-smi", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log", type=Path, default=None, help="the run's console log (names the weight-sync path)")
    ap.add_argument("--bench", type=Path, default=None, help="scripts/gpu_check_bench.py's JSON")
    args = ap.parse_args(argv)
    metrics = args.run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    report = build_report(rows, steps=args.steps, exit_code=args.exit_code, device=args.device,
                          smi_peak_mib=nvidia_smi_peak_mib(args.nvidia_smi),
                          log_text=args.log.read_text(errors="replace") if args.log and args.log.is_file() else None)
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
