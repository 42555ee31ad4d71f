"""How hard a task is for a model before any RL step: the greedy accuracy on the held-out split (the run's step-0
evaluation) and the reward of sampled training rollouts (what GRPO learns from), for choosing a study's task.

    python bench/task_difficulty.py --config examples/math/smollm2_add_m2po_cpu.yaml --batches 4 [key=value ...]

Builds the run's trainer from the config and overrides (nothing is trained, nothing written but a temporary
directory), evaluates once, then generates ``--batches`` training batches with the config's sampling and prints the
mean reward, the share of prompts whose group has at least one correct and one wrong sample (the groups that carry
a GRPO signal), and the time of each part.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--batches", type=int, default=4, help="training batches to sample (default 4)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.batches < 1:
        ap.error(f"--batches={args.batches}: expected >= 1")

    from stalerl.config import load_config
    from stalerl.training.trainer import Trainer

    work = tempfile.mkdtemp(prefix="stalerl-task-")
    cfg = load_config(["--config", args.config, f"cluster.fileroot={work}", "recover.mode=disabled",
                       "stats_logger.tensorboard=false", "warm_start.steps=0", *args.overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.warm_start_done = True
    t0 = time.perf_counter()
    acc = trainer.evaluate().get("eval/accuracy")
    t_eval = time.perf_counter() - t0
    d = cfg.train_dataset.synthetic
    print(f"task {d.task} max_operand {d.max_operand} ({d.question_style}, holdout {d.holdout}), model "
          f"{cfg.actor.path}: step-0 greedy accuracy {acc:.4f} on {cfg.evaluator.n_prompts} held-out problems "
          f"({t_eval:.0f} s)")
    rewards, mixed, groups = [], 0, 0
    n = cfg.gconfig.n_samples
    t0 = time.perf_counter()
    for _ in range(args.batches):
        batch = trainer.source.generate_batch()
        r = batch.rewards.reshape(-1, n)
        rewards += r.flatten().tolist()
        correct = (r > 0.5).sum(dim=1)
        mixed += int(((correct > 0) & (correct < n)).sum())
        groups += r.shape[0]
    t_gen = time.perf_counter() - t0
    print(f"sampled (T {cfg.gconfig.temperature}, {n} per prompt, {len(rewards)} samples): mean reward "
          f"{sum(rewards) / len(rewards):.4f}; groups with a GRPO signal {mixed}/{groups} ({t_gen:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
