"""Throughput of the asynchronous runtime against the synchronous loop, on the embedded default.

    python bench/async_throughput.py [--steps 80] [--etas 1 4 16]

Runs, one after another, each with one torch thread per process: the synchronous loop (rollout then training in
one process) and asynchronous d1+d1 (one rollout worker process, one train rank) for each max_head_offpolicyness
eta. Prints steps/min, tokens/s of each role, the staleness actually observed, and the speed-up against the ideal
(t_gen + t_train) / max(t_gen, t_train) computed from the synchronous run's per-step times. Measured in one process
tree, one after another; never asserted on.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stalerl.results.metrics_log import read_metrics  # noqa: E402

CONFIG = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"


def run(root: Path, trial: str, steps: int, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "stalerl.launch.cli", "--config", str(CONFIG), f"cluster.fileroot={root}",
           f"trial_name={trial}", f"total_train_steps={steps}", "torch_threads=1", "warm_start.steps=300",
           "evaluator.freq_steps=null", "stats_logger.progress_bar=false", "stats_logger.tensorboard=false",
           "recover.mode=disabled", "rollout.fixed_staleness=0", *extra]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [r for r in read_metrics(root / "gsm8k-m2po-cpu" / trial) if r["step"] > 0]


def summarize(rows: list[dict], skip: int) -> dict:
    startup = rows[0].get("timing/startup_overhead_s")
    rows = rows[skip:]
    step_s = sum(r["timing/step_s"] for r in rows) / len(rows)
    return {
        "step_s": step_s,
        "steps_per_min": 60.0 / step_s,
        "gen_tok_s": statistics.mean(r["throughput/gen_tokens_per_s"] for r in rows),
        "train_tok_s": statistics.mean(r["throughput/train_tokens_per_s"] for r in rows),
        "stale_avg": statistics.mean(r["staleness/avg"] for r in rows),
        "stale_max": max(r["staleness/max"] for r in rows),
        "t_gen": statistics.mean(r.get("timing/gen_s", 0.0) for r in rows),
        "t_train": statistics.mean(r["timing/train_s"] for r in rows),
        "wait": statistics.mean(r.get("timing/wait_for_data_s", 0.0) for r in rows),
        "startup": startup,
        "publish_ms": 1e3 * statistics.mean(r.get("timing/weight_publish_s", 0.0) for r in rows),
        "load_ms": 1e3 * statistics.mean(r.get("timing/weight_load_s", 0.0) for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--skip", type=int, default=10, help="first steps left out (start-up, queue filling)")
    ap.add_argument("--etas", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = {"sync (eta=0, one process)": summarize(run(root, "sync", args.steps, ["rollout.mode=sync"]),
                                                          args.skip)}
        for eta in args.etas:
            rows = run(root, f"async{eta}", args.steps + 0,
                       ["rollout.mode=async", f"rollout.max_head_offpolicyness={eta}"])
            results[f"async d1+d1 eta={eta}"] = summarize(rows, args.skip)
    base = results["sync (eta=0, one process)"]
    ideal = (base["t_gen"] + base["t_train"]) / max(base["t_gen"], base["t_train"])
    print(f"sync per step: t_gen {base['t_gen'] * 1e3:.1f} ms, t_train {base['t_train'] * 1e3:.1f} ms -> ideal "
          f"d1+d1 speed-up {ideal:.2f}x")
    print(f"{'run':28s} {'s/step':>7s} {'steps/min':>9s} {'gen tok/s':>9s} {'train tok/s':>11s} "
          f"{'stale avg/max':>13s} {'wait s':>7s} {'speed-up':>8s} {'% of ideal':>10s} {'startup s':>9s} "
          f"{'sync ms (publish/load)':>22s}")
    for name, r in results.items():
        speed = base["step_s"] / r["step_s"]
        of_ideal = "-" if r is base else f"{100 * speed / ideal:.0f}%"
        print(f"{name:28s} {r['step_s']:7.3f} {r['steps_per_min']:9.1f} {r['gen_tok_s']:9.0f} {r['train_tok_s']:11.0f} "
              f"{r['stale_avg']:6.2f}/{r['stale_max']:<6.0f} {r['wait']:7.3f} {speed:7.2f}x {of_ideal:>10s} "
              f"{r['startup'] or 0:9.1f} {r['publish_ms']:10.1f}/{r['load_ms']:<10.1f}")


if __name__ == "__main__":
    main()
