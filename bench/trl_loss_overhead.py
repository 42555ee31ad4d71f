"""Step time of TRL's GRPOTrainer with stalerl's losses against TRL's own ``loss_type="grpo"``, same process.

    python bench/trl_loss_overhead.py [--steps 6] [--repeats 3] [--new-tokens 32] [--threads 2] [--shape small|tiny]

Needs ``trl`` (pip install "stalerl[trl]" in a venv of its own; scripts/ci_trl.sh builds one). Every run builds the
same from-scratch Qwen2 (small: hidden 256, 4 layers; tiny: hidden 128, 2 layers; char tokenizer, seed 0) and trains
``--steps`` optimizer steps on the same prompts with recipe.trl.GRPOTrainer; only ``loss_type`` changes. The runs are
interleaved (grpo, m2po, fipo, grpo, ...) so load drift on a shared machine hits all alike. Two settings:

- ``on-policy``: TRL's default (num_iterations=1, one micro-batch per step): no behaviour log-probs.
- ``reuse``: num_iterations=2, gradient_accumulation_steps=2 (steps_per_generation=2): the reuse pass is off-policy,
  M2PO's exact selection runs a no-grad forward over the step's other micro-batch.

Printed: the median CPU seconds per optimizer step (``time.process_time``, all threads: the figure that stays
meaningful on a shared machine), the median wall seconds per step and per ``_compute_loss`` call (the part the loss
changes), first step of each run excluded, and the ratios against grpo. Goal: at most 5% step-time overhead.
``--loss-only`` times just ``_compute_loss`` + backward on one reused batch (what the loss choice changes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=768),
    # the embedded default's size: the loss is the largest share of a step here, so the overhead is at its largest
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=512),
}
SETTINGS = {
    "on-policy": dict(num_iterations=1, per_device_train_batch_size=16, gradient_accumulation_steps=1),
    "reuse": dict(num_iterations=2, per_device_train_batch_size=8, gradient_accumulation_steps=2),
}
LOSSES = ("grpo", "m2po", "fipo")


def run_once(loss_type: str, setting: str, steps: int, new_tokens: int, shape: str
             ) -> tuple[list[float], list[float], list[float]]:
    from datasets import Dataset
    from transformers import TrainerCallback

    from recipe.trl import GRPOConfig, GRPOTrainer
    from stalerl.core.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model("qwen2", tok, seed=0, **SHAPES[shape])
    data = Dataset.from_dict({"prompt": [f"Q: {i}+{3 * i + 7}=? A:" for i in range(64)]})

    def reward(prompts, completions, **_):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    step_s: list[float] = []
    step_cpu: list[float] = []
    loss_s: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            step_s.append(time.perf_counter() - self.t)
            step_cpu.append(time.process_time() - self.cpu)

    class Timed(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            t = time.perf_counter()
            out = super()._compute_loss(model, inputs)
            loss_s.append(time.perf_counter() - t)
            return out

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, use_cpu=True, report_to="none", bf16=False, seed=0, loss_type=loss_type,
                         num_generations=4, max_completion_length=new_tokens, temperature=1.0, learning_rate=1e-5,
                         beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                         dataloader_num_workers=0, **SETTINGS[setting])
        Timed(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
              callbacks=[Clock()]).train()
    return step_s[1:], step_cpu[1:], loss_s[2:]


def loss_only(repeats: int, calls: int) -> None:
    """``_compute_loss`` + backward on one and the same reused (off-policy) batch, per loss, interleaved."""
    import torch
    from datasets import Dataset

    from recipe.trl import GRPOConfig, GRPOTrainer
    from stalerl.core.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    data = Dataset.from_dict({"prompt": [f"Q: {i}+{2 * i + 1}=? A:" for i in range(16)]})

    def reward(prompts, completions, **_):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    trainers = {}
    for loss in LOSSES:  # one step each, so every trainer holds a batch with old_per_token_logps
        model = build_tiny_model("qwen2", tok, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, intermediate_size=128, seed=0)
        cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", bf16=False, seed=0,
                         loss_type=loss, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                         num_iterations=2, max_steps=1, save_strategy="no", disable_tqdm=True, beta=0.0)
        trainers[loss] = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                                     processing_class=tok)
        trainers[loss].train()
    batch = trainers["grpo"]._buffered_inputs[0]
    times: dict[str, list[float]] = {loss: [] for loss in LOSSES}
    for _ in range(repeats):
        for loss, trainer in trainers.items():
            trainer.model.train()
            for _ in range(calls):
                trainer._buffered_inputs, trainer._step, trainer._stalerl_plan = [batch], 0, None
                t = time.perf_counter()
                trainer._compute_loss(trainer.model, batch).backward()
                times[loss].append(time.perf_counter() - t)
    base = statistics.median(times["grpo"])
    for loss in LOSSES:
        med = statistics.median(times[loss])
        print(f"loss-only {loss:5s} _compute_loss+backward {med * 1e3:.1f} ms ({med / base:.2f}x grpo)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", default="on-policy,reuse")
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--loss-only", action="store_true",
                    help="time only _compute_loss + backward on one reused batch (64-hidden test model, 8 rows x 8 "
                         "new tokens), 5 x 20 calls per loss")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.loss_only:
        loss_only(5, 20)
        return
    print(f"TRL GRPOTrainer, tiny Qwen2 {SHAPES[args.shape]}, 4 prompts x 4 completions per step, "
          f"{args.new_tokens} new tokens, {args.steps} steps x {args.repeats} repeats, {args.threads} threads",
          flush=True)
    for setting in args.settings.split(","):
        steps = {loss: [] for loss in LOSSES}
        cpu = {loss: [] for loss in LOSSES}
        losses = {loss: [] for loss in LOSSES}
        for _ in range(args.repeats):
            for loss in LOSSES:
                s, c, l_ = run_once(loss, setting, args.steps, args.new_tokens, args.shape)
                steps[loss] += s
                cpu[loss] += c
                losses[loss] += l_
        base = {name: statistics.median(d["grpo"]) for name, d in (("wall", steps), ("cpu", cpu), ("loss", losses))}
        for loss in LOSSES:
            wall, cpu_s, call = (statistics.median(d[loss]) for d in (steps, cpu, losses))
            print(f"{setting:9s} {loss:5s} CPU s/step {cpu_s:.3f} ({cpu_s / base['cpu']:.3f}x grpo)   wall s/step "
                  f"{wall:.3f} ({wall / base['wall']:.3f}x)   wall s/_compute_loss {call:.4f} "
                  f"({call / base['loss']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
