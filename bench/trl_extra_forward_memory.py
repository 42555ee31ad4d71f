"""Peak memory that M2PO's extra no-grad forwards add to a TRL optimizer step, against TRL's own ``dapo``, CPU.

    python bench/trl_extra_forward_memory.py [--shape small|medium] [--new-tokens 64] [--steps 4]

Needs ``trl`` (its venv: scripts/ci_trl.sh). With M2PO and behaviour log-probs, recipe.trl.GRPOTrainer computes, at
an optimizer step's first micro-batch, the current log-probs of the step's other micro-batches without grad, while
micro-batch 0's autograd graph is held. This script measures what that costs in resident memory, on CPU, where RSS
is the only memory gauge: the process re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` (so freed tensors go
back to the OS and RSS tracks live memory) and resets the peak (``/proc/self/clear_refs``, ``VmHWM``) around

- each extra forward: its peak above the RSS when it started (what it adds on top of the held graph), and
- each optimizer step (reuse steps only): the step's peak above the RSS at its start,

for ``m2po`` and for TRL's ``dapo`` (same model, data, batch shapes; reuse setting: num_iterations 2, 2 micro-batches
per step, so the second step of each generation is off-policy and M2PO runs its extra forward). Printed: MiB and
the ratio of the step peaks (m2po / dapo). Figures, not assertions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=768),
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                   intermediate_size=1536),
}


def _status(field: str) -> int:
    """A /proc/self/status memory field in KiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets VmHWM to the current RSS


def run(loss_type: str, shape: str, new_tokens: int, steps: int) -> dict[str, list[float]]:
    from datasets import Dataset

    from recipe.trl import GRPOConfig, GRPOTrainer
    from stalerl.core.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model("qwen2", tok, seed=0, **SHAPES[shape])
    data = Dataset.from_dict({"prompt": [f"Q: {i}+{3 * i + 7}=? A:" for i in range(64)]})

    def reward(prompts, completions, **_):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    found: dict[str, list[float]] = {"extra": [], "step": []}

    class Measured(GRPOTrainer):
        def _extra_log_probs(self, batch):
            before = _status("VmRSS")
            _reset_peak()
            out = super()._extra_log_probs(batch)
            found["extra"].append((_status("VmHWM") - before) / 1024)
            return out

        def training_step(self, model, inputs, num_items_in_batch):
            ga = self.current_gradient_accumulation_steps
            first = self._step % ga == 0
            reuse = (self._step // ga) % 2 == 1  # num_iterations 2, steps_per_generation == ga: every 2nd step
            if first:
                self._bench_start = _status("VmRSS")
                _reset_peak()
            out = super().training_step(model, inputs, num_items_in_batch)
            if self._step % ga == 0 and reuse:  # the step's last micro-batch has run (TRL counted it)
                found["step"].append((_status("VmHWM") - self._bench_start) / 1024)
            return out

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, use_cpu=True, report_to="none", bf16=False, seed=0, loss_type=loss_type,
                          per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                          max_completion_length=new_tokens, num_iterations=2, max_steps=steps, logging_steps=1,
                          save_strategy="no", disable_tqdm=True, beta=0.0, learning_rate=1e-3)
        Measured(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok).train()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loss", default=None, help=argparse.SUPPRESS)  # one run (the re-executed child)
    args = parser.parse_args()
    if args.loss is None:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
                   OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
        results = {}
        for loss in ("dapo", "m2po"):
            proc = subprocess.run([sys.executable, __file__, "--loss", loss, "--shape", args.shape,
                                   "--new-tokens", str(args.new_tokens), "--steps", str(args.steps)],
                                  env=env, capture_output=True, text=True, check=True)
            results[loss] = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's dict
        dapo, m2po = results["dapo"], results["m2po"]
        print(f"shape {args.shape}, {args.new_tokens} new tokens, 2 micro-batches of 8 rows, num_iterations 2")
        print(f"m2po extra no-grad forward: peak above its start RSS, median {statistics.median(m2po['extra']):.1f} "
              f"MiB (max {max(m2po['extra']):.1f}, {len(m2po['extra'])} forwards)")
        step_d, step_m = statistics.median(dapo["step"]), statistics.median(m2po["step"])
        print(f"reuse-step peak above the step's start RSS: dapo {step_d:.1f} MiB, m2po {step_m:.1f} MiB "
              f"(ratio {step_m / step_d:.2f}; {len(dapo['step'])} / {len(m2po['step'])} steps)")
        return
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(run(args.loss, args.shape, args.new_tokens, args.steps))


if __name__ == "__main__":
    main()
