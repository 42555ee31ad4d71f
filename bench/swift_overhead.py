"""Step time of ms-swift's GRPO (HF backend, CPU) with ``--loss_type m2po`` / ``fipo_ref`` (recipe.swift) against
ms-swift's own ``--loss_type grpo`` on the same work, in one process; prints ratios against ``grpo``.

    python bench/swift_overhead.py [--steps 8] [--rounds 2] [--hidden 256] [--layers 4] [--new-tokens 32] \
        [--accumulation 2]

Run it in the ms-swift environment (scripts/ci_swift.sh builds one). Every run goes through
``swift.pipelines.rlhf_main`` (what ``swift rlhf`` runs) with the same tiny from-scratch Qwen2 (byte tokenizer, built
locally), prompts, seed, 4 prompts x 4 generations per optimizer step, as ``--accumulation`` micro-batches (default 2:
M2PO's whole-step selection then pays one extra no-grad forward for the second micro-batch; with 1, ms-swift's GRPO
default, it pays none), ``num_iterations 2`` (every generation batch is trained twice: the second pass is stale),
AdamW, no KL. ``grpo`` runs ms-swift's own trainer class; ``m2po`` and
``fipo_ref`` run recipe.swift's subclass. Runs alternate between the loss types for ``--rounds`` rounds.

Measured per optimizer step: the wall time of its micro-steps' ``training_step`` (generation every other step,
log-prob passes, loss, backward; the optimizer step itself is the same for all and left out), and the time inside
``compute_loss`` (forward + loss). The first two steps of every run (warm-up, first generation) are left out; the
figure is the median of the rest, pooled over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integrations" / "swift"))
LOSSES = ("grpo", "m2po", "fipo_ref")
SWIFT_TRAINER = "swift.rlhf_trainers.GRPOTrainer"
WARMUP_STEPS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=2, choices=(1, 2, 4),
                        help="gradient-accumulation steps (16 completions per step, split evenly)")
    opts = parser.parse_args()
    if opts.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be > {WARMUP_STEPS} (the first {WARMUP_STEPS} steps are warm-up)")
    os.environ.update(OMP_NUM_THREADS=str(opts.threads), TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")

    import torch
    from _swift_tiny import build_model_dir, write_dataset, write_plugins
    from swift.pipelines import rlhf_main
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer as SwiftGRPOTrainer
    from swift.trainers import TrainerFactory
    from swift.utils.utils import import_external_file

    from recipe.swift import plugin_path

    torch.set_num_threads(opts.threads)
    root = Path(tempfile.mkdtemp(prefix="swift-bench-"))
    model = build_model_dir(root / "model", hidden_size=opts.hidden, layers=opts.layers)
    data = write_dataset(root / "data.jsonl", n=256)
    reward, _ = write_plugins(root / "plugins")
    import_external_file(plugin_path())  # now, so that setting the mapping per run below is what counts

    timings: dict[str, list[float]] = defaultdict(list)  # per micro-step, reset per run
    original_step = SwiftGRPOTrainer.training_step
    original_loss = SwiftGRPOTrainer.compute_loss

    def timed_step(self, *args, **kwargs):
        start = time.perf_counter()
        out = original_step(self, *args, **kwargs)
        timings["step"].append(time.perf_counter() - start)
        return out

    def timed_loss(self, *args, **kwargs):
        start = time.perf_counter()
        out = original_loss(self, *args, **kwargs)
        timings["loss"].append(time.perf_counter() - start)
        return out

    SwiftGRPOTrainer.training_step = timed_step
    SwiftGRPOTrainer.compute_loss = timed_loss

    accumulation = opts.accumulation
    step_times: dict[str, list[float]] = defaultdict(list)
    loss_times: dict[str, list[float]] = defaultdict(list)
    for rnd in range(opts.rounds):
        for loss in LOSSES:
            TrainerFactory.TRAINER_MAPPING["grpo"] = SWIFT_TRAINER if loss == "grpo" else "recipe.swift.trainer.GRPOTrainer"
            timings.clear()
            argv = [
                "--rlhf_type", "grpo", "--loss_type", loss, "--external_plugins", plugin_path(), str(reward),
                "--model", str(model), "--model_type", "qwen2", "--template", "qwen2_5", "--torch_dtype", "float32",
                "--check_model", "false", "--dataset", str(data), "--split_dataset_ratio", "0",
                "--dataset_num_proc", "1", "--reward_funcs", "tiny_parity", "--tuner_type", "full",
                "--num_generations", "4", "--per_device_train_batch_size", str(16 // accumulation),
                "--gradient_accumulation_steps", str(accumulation), "--num_iterations", "2",
                "--max_steps", str(opts.steps), "--max_completion_length", str(opts.new_tokens),
                "--temperature", "1.0", "--beta", "0", "--learning_rate", "1e-4", "--lr_scheduler_type", "constant",
                "--warmup_ratio", "0", "--logging_steps", "1000", "--save_strategy", "no", "--eval_strategy", "no",
                "--report_to", "none", "--dataloader_num_workers", "0", "--seed", "0",
                "--output_dir", str(root / f"{loss}-{rnd}"),
            ]
            rlhf_main(argv)
            per_step = [sum(timings["step"][i:i + accumulation]) for i in range(0, len(timings["step"]), accumulation)]
            per_loss = [sum(timings["loss"][i:i + accumulation]) for i in range(0, len(timings["loss"]), accumulation)]
            step_times[loss] += per_step[WARMUP_STEPS:]
            loss_times[loss] += per_loss[WARMUP_STEPS:]
            print(f"round {rnd} {loss}: median step {statistics.median(per_step[WARMUP_STEPS:]):.3f}s", flush=True)

    base_step = statistics.median(step_times["grpo"])
    base_loss = statistics.median(loss_times["grpo"])
    result = {"config": vars(opts), "torch_threads": opts.threads}
    print(f"\nms-swift GRPO on CPU: hidden {opts.hidden}, {opts.layers} layers, {opts.new_tokens} new tokens, "
          f"16 completions/step as {accumulation} x {16 // accumulation}, num_iterations 2; medians over "
          f"{len(step_times['grpo'])} steps per loss")
    print(f"{'loss_type':<10} {'step s':>8} {'x grpo':>7} {'compute_loss s':>15} {'x grpo':>7}")
    for loss in LOSSES:
        step = statistics.median(step_times[loss])
        lossed = statistics.median(loss_times[loss])
        result[loss] = {"step_s": step, "step_ratio": step / base_step, "compute_loss_s": lossed,
                        "compute_loss_ratio": lossed / base_loss}
        print(f"{loss:<10} {step:8.3f} {step / base_step:7.3f} {lossed:15.3f} {lossed / base_loss:7.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
