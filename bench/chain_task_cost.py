"""What a step and an eval of the chained-addition task cost, against the `add` task, in the same process.

Each task's config (examples/math/gsm8k_m2po_cpu.yaml = `add`, gsm8k_chain_cpu.yaml = `chain`) is built with no
warm start (an untrained model samples to max_new_tokens, so its responses are as long as a trained one's: 10 vs
32 tokens), one thread; then a few RL steps (no_trust_region at fixed_staleness 4) and one full eval are timed. CPU
seconds (``time.process_time``) are reported beside wall seconds: on a shared machine the wall clock measures the
neighbours, while one single-threaded run's CPU time is what it needs on an idle core (on a crowded machine even CPU
time inflates, so the chain/add *ratios* are the robust figures). The last lines project the wall time of a study
grid, runs x (steps x step + evals x eval) / parallel, plus one warm start per seed: once from the CPU seconds
measured here, once calibrated: the ratios times the `add` task's idle figures (``--add-step-s``,
``--add-eval-s``; defaults from the committed staleness study: 61 s of steps for 300 steps and ~3 s for 7 evals of
256 problems per run, 2 runs at a time on 2 cores).

    python bench/chain_task_cost.py
    python bench/chain_task_cost.py --steps 8 --runs 18 --train-steps 400 --parallel 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from stalerl.config import load_config
from stalerl.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"add": REPO / "examples/math/gsm8k_m2po_cpu.yaml", "chain": REPO / "examples/math/gsm8k_chain_cpu.yaml"}


def measure(task: str, steps: int, fileroot: str) -> dict[str, float]:
    cfg = load_config(["--config", str(CONFIGS[task]), "warm_start.steps=0", "torch_threads=1",
                       "actor.loss=no_trust_region", f"cluster.fileroot={fileroot}", f"trial_name=bench-{task}",
                       "recover.mode=disabled", "stats_logger.tensorboard=false", "stats_logger.progress_bar=false"])
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.train_step()  # first step: lazy initialisation
    c0, w0 = time.process_time(), time.perf_counter()
    lengths = []
    for _ in range(steps):
        m = trainer.train_step()
        lengths.append(m["response_length"])
    c1, w1 = time.process_time(), time.perf_counter()
    trainer.evaluate()
    c2, w2 = time.process_time(), time.perf_counter()
    return {"step_cpu": (c1 - c0) / steps, "step_wall": (w1 - w0) / steps, "eval_cpu": c2 - c1, "eval_wall": w2 - w1,
            "eval_problems": len(trainer.valid_examples), "response_tokens": sum(lengths) / len(lengths),
            "eval_every": cfg.evaluator.freq_steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="timed RL steps per task")
    p.add_argument("--runs", type=int, default=18, help="runs of the grid to project (pilot: 18)")
    p.add_argument("--train-steps", type=int, default=400, help="RL steps per run of the grid")
    p.add_argument("--parallel", type=int, default=2, help="runs at once (single-threaded)")
    p.add_argument("--warm-start-s", type=float, default=0.0, help="CPU seconds of one warm start (seeds run in "
                                                                  "parallel like runs)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--fileroot", default="/tmp/stalerl-bench-chain")
    p.add_argument("--add-step-s", type=float, default=0.204, help="idle wall seconds per add step (calibration)")
    p.add_argument("--add-eval-s", type=float, default=0.45, help="idle wall seconds per add eval of 256 problems")
    p.add_argument("--eval-every", type=int, default=None, help="eval spacing of the grid (default: the config's)")
    a = p.parse_args()
    torch.set_num_threads(1)
    res = {task: measure(task, a.steps, a.fileroot) for task in ("add", "chain")}
    for task, r in res.items():
        print(f"{task:5s}: step {r['step_cpu']:.3f} s CPU ({r['step_wall']:.3f} s wall), response "
              f"{r['response_tokens']:.1f} tokens; eval of {r['eval_problems']} problems {r['eval_cpu']:.2f} s CPU "
              f"({r['eval_wall']:.2f} s wall)")
    print(f"ratio chain/add: step x{res['chain']['step_cpu'] / res['add']['step_cpu']:.2f} CPU, "
          f"eval x{res['chain']['eval_cpu'] / res['add']['eval_cpu']:.2f} CPU")
    c = res["chain"]
    evals = a.train_steps // (a.eval_every or c["eval_every"]) + 1
    step_ratio, eval_ratio = c["step_cpu"] / res["add"]["step_cpu"], c["eval_cpu"] / res["add"]["eval_cpu"]
    for name, step_s, eval_s in (("from CPU seconds", c["step_cpu"], c["eval_cpu"]),
                                 ("calibrated on add", step_ratio * a.add_step_s, eval_ratio * a.add_eval_s)):
        per_run = a.train_steps * step_s + evals * eval_s
        grid = a.runs * per_run / a.parallel + (a.seeds / a.parallel) * a.warm_start_s
        print(f"projected ({name}): chain run of {a.train_steps} steps with {evals} evals {per_run / 60:.1f} min; "
              f"grid of {a.runs} runs, {a.parallel} at a time (+ {a.seeds} warm starts of {a.warm_start_s:.0f} s): "
              f"{grid / 60:.0f} min")


if __name__ == "__main__":
    main()
