"""End to end against TRL's GRPOTrainer on CPU: seconds per optimizer step, same model, prompts, group size, max new
tokens, optimizer and thread budget; ratios against TRL measured by this same script.

    python bench/trl_vs_stalerl.py [--systems trl,sync,async] [--engine hf|vllm] [--steps 35] [--warmup 5]
                                   [--new-tokens 64] [--shape medium|small|tiny] [--trl-python PY]

Needs ``trl`` in the running environment or in ``--trl-python``'s (pip install "stalerl[trl]" in a venv of its
own). With ``--engine vllm`` stalerl's runs use rollout.backend=vllm:d1 (run it from the vLLM venv, which then also
needs trl).

Setup (every system): the from-scratch Qwen2 of bench/vllm_throughput.py "medium" (hidden 512, 8 layers, ~27M
parameters, random init with seed 1, char tokenizer; ``--shape small``: hidden 256, 4 layers, ~3.4M; ``tiny``: 0.54M),
synthetic addition prompts, 4 prompts x group 4 per step, temperature 1, max new tokens as given, AdamW lr 1e-5 betas
(0.9, 0.99) no weight decay, clip 1.0, constant lr, no KL term, one optimizer step per batch, PPO-clip loss (TRL
loss_type=grpo, stalerl actor.loss=vanilla). Threads: 2 in all (TRL and stalerl sync: one process x 2; stalerl async
d1+d1: two processes x 1).

Steady state: the first ``--warmup`` steps (model start-up, vLLM start, the async pipeline filling: with
max_head_offpolicyness=1 it is full after two steps) are excluded; the figures are over the remaining steps (at least
30 by default): the mean seconds per step (window wall time / steps, what throughput is) and the median. The ratios
are steps/s against TRL, from the means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPES = {
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                   intermediate_size=1536, max_position_embeddings=512),
    # ~3.4M parameters: for a 35-step steady-state run on a shared 2-core machine
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=768, max_position_embeddings=512),
    # the embedded default's size (0.54M parameters): per-step framework overhead dominates, as on a loaded machine
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=512, max_position_embeddings=512),
}
SHAPE = dict(SHAPES["medium"])
PROMPTS, GROUP, LR, SEED = 4, 4, 1e-5, 1


def run_trl(steps: int, new_tokens: int, threads: int) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stalerl.data import load_examples
    from stalerl.core.model import PromptFormatter, build_char_tokenizer, build_tiny_model
    from stalerl.core.reward import gsm8k_reward

    torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    model = build_tiny_model("qwen2", tok, seed=SEED, **SHAPE)
    fmt = PromptFormatter(tok).format
    examples = load_examples("synthetic", "train", train_size=PROMPTS * (steps + 2))
    data = Dataset.from_dict({"prompt": [fmt(e.question) for e in examples], "answer": [e.final for e in examples]})

    def reward(prompts, completions, answer, **_):
        return [float(gsm8k_reward(c, a)) for c, a in zip(completions, answer)]

    durations: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            durations.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                         generation_batch_size=PROMPTS * GROUP, max_completion_length=new_tokens, temperature=1.0,
                         top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="grpo", learning_rate=LR,
                         adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                         lr_scheduler_type="constant", max_steps=steps, logging_steps=1, report_to="none",
                         save_strategy="no", use_cpu=True, seed=SEED, disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                              callbacks=[Clock()])
        trainer.train()
    return durations


def run_stalerl(mode: str, engine: str, steps: int, new_tokens: int, threads: int, root: Path,
                warmup: int) -> list[float]:
    over = {
        "actor.path": "tiny:qwen2", **{f"actor.tiny.{k}": v for k, v in SHAPE.items()},
        "seed": SEED, "warm_start.steps": 0, "total_train_steps": steps, "train_dataset.batch_size": PROMPTS,
        "train_dataset.synthetic.train_size": PROMPTS * (steps + 2), "gconfig.n_samples": GROUP,
        "gconfig.max_new_tokens": new_tokens, "eval_gconfig.max_new_tokens": new_tokens, "evaluator.freq_steps": "null",
        "evaluator.at_start": False, "recover.mode": "disabled", "saver.save_final": False, "actor.loss": "vanilla",
        "actor.optimizer.lr": LR, "actor.optimizer.weight_decay": 0.0, "actor.ppo_n_minibatches": 1,
        "rollout.fixed_staleness": 0, "rollout.backend": f"{engine}:d1", "stats_logger.tensorboard": False,
        "stats_logger.progress_bar": False, "cluster.fileroot": str(root), "trial_name": mode,
    }
    if mode == "sync":
        over.update({"rollout.mode": "sync", "torch_threads": threads})
    else:  # d1 + d1: two processes share the thread budget
        over.update({"rollout.max_head_offpolicyness": 1, "torch_threads": max(1, threads // 2)})
    cmd = [sys.executable, str(REPO / "examples/math/gsm8k_rl.py"),
           "--config", str(REPO / "examples/math/gsm8k_m2po_cpu.yaml"), *[f"{k}={v}" for k, v in over.items()]]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="ERROR")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"stalerl {mode} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / "gsm8k-m2po-cpu" / mode / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r]
    parts = [k for k in ("timing/gen_s", "timing/wait_for_data_s", "timing/train_s") if k in rows[0]]
    steady = rows[warmup:] or rows
    print(f"  stalerl {mode}: median over the steady steps: " + ", ".join(
        f"{k} {statistics.median(r[k] for r in steady):.2f}" for k in parts), flush=True)
    return [r["timing/step_s"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="trl,sync,async")
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--warmup", type=int, default=5, help="first steps excluded (start-up, pipeline filling)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="medium", choices=sorted(SHAPES), help="model size (medium: ~27M parameters)")
    ap.add_argument("--trl-python", default=sys.executable,
                    help="interpreter with trl installed for the TRL run (e.g. the venv of scripts/ci_trl.sh), so "
                         "stalerl's runs can use the project's own environment")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    SHAPE.clear()
    SHAPE.update(SHAPES[args.shape])
    if args.child == "trl":
        print(json.dumps(run_trl(args.steps, args.new_tokens, args.threads)))
        return
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    print(f"{args.shape} model, {PROMPTS} prompts x group {GROUP}, {args.new_tokens} new tokens, {args.steps} steps "
          f"(first {args.warmup} excluded), {args.threads} threads, stalerl engine {args.engine}", flush=True)
    per_step: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root:
        for system in args.systems.split(","):
            if system == "trl":
                res = subprocess.run([args.trl_python, __file__, "--child", "trl", "--shape", args.shape,
                                      "--steps", str(args.steps),
                                      "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)],
                                     capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
                if res.returncode != 0:
                    raise RuntimeError(f"TRL failed:\n{res.stderr[-3000:]}")
                durations = json.loads(res.stdout.strip().splitlines()[-1])
            else:
                durations = run_stalerl(system, args.engine, args.steps, args.new_tokens, args.threads, Path(root),
                                        args.warmup)
            steady = durations[args.warmup:]
            per_step[system] = statistics.fmean(steady)
            start_up = ", ".join(f"{d:.2f}" for d in durations[:args.warmup])
            print(f"{system:6s} steady {len(steady)} steps: mean s/step {per_step[system]:7.2f}, median "
                  f"{statistics.median(steady):7.2f}  (start-up steps: {start_up})", flush=True)
    if "trl" in per_step:
        for system, s in per_step.items():
            if system != "trl":
                print(f"steps/s {system} / trl = {per_step['trl'] / s:.2f}x")


if __name__ == "__main__":
    main()
