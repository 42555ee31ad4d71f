"""End to end against TRL's GRPOTrainer on CPU: seconds per optimizer step, same model, prompts, group size, max new
tokens, optimizer and thread budget; ratios against TRL measured by this same script.

    python bench/trl_vs_stalerl.py [--systems trl,sync,async] [--engine hf|vllm] [--steps 35] [--warmup 5]
                                   [--new-tokens 64] [--shape medium|small|tiny] [--trl-python PY]
    python bench/trl_vs_stalerl.py --model smollm2-135m-instruct|DIR [--steps 12] [--warmup 3] [--new-tokens 32]
                                   [--max-operand 20] [--trl-python PY]

Needs ``trl`` in the running environment or in ``--trl-python``'s (pip install "stalerl[trl]" in a venv of its
own). With ``--engine vllm`` stalerl's runs use rollout.backend=vllm:d1 (run it from the vLLM venv, which then also
needs trl).

Setup (every system): the from-scratch Qwen2 of bench/vllm_throughput.py "medium" (hidden 512, 8 layers, ~27M
parameters, random init with seed 1, char tokenizer; ``--shape small``: hidden 256, 4 layers, ~3.4M; ``tiny``: 0.54M),
synthetic addition prompts, 4 prompts x group 4 per step, temperature 1, max new tokens as given, AdamW lr 1e-5 betas
(0.9, 0.99) no weight decay, clip 1.0, constant lr, no KL term, one optimizer step per batch, PPO-clip loss (TRL
loss_type=grpo, stalerl actor.loss=vanilla). Threads: 2 in all (TRL and stalerl sync: one process x 2; stalerl async
d1+d1: two processes x 1). The prompts are the same questions in the same order in both (no shuffling).

``--model`` (a local Hugging Face directory, or a known name such as smollm2-135m-instruct, resolved with
stalerl.core.model_store.resolve_model_path: fetched and converted once into $STALERL_CACHE): that real model in
float32 in every system, with its own tokenizer and chat template. TRL gets conversational prompts
``[{"role": "user", "content": question + " Answer with just the number."}]`` and applies the chat template itself;
stalerl runs examples/math/smollm2_add_grpo_cpu.yaml (prompt.format=chat, the same instruction). Questions: the
synthetic ``add`` task in the ``what_is`` style ("What is 7+12?"), operands <= ``--max-operand`` (default 20), the
same train split (same strings, same order) in both; temperature 0.7 (``--temperature``), 32 new tokens by default,
generation stopping at the tokenizer's eos and the generation config's eos ids (<|im_end|> for SmolLM2-Instruct) in
both. Reward in both: stalerl.core.reward.gsm8k_reward on the decoded completion (special tokens skipped). The
per-system line adds the mean reward over all steps; stalerl's lines add the median of its per-step timing split
(timing/split/*: generation, log-prob passes, forward/backward, optimizer) over the steady steps.

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
INSTRUCTION = " Answer with just the number."  # --model: appended to every question (the smollm2 example's)
REAL_CONFIG = REPO / "examples/math/smollm2_add_grpo_cpu.yaml"  # --model: stalerl's base config (chat prompts)


def synthetic_test_size(max_operand: int) -> int:
    """The synthetic test split's size in --model runs (it decides which problems the train split leaves out): the
    smollm2 example's 128, or at most half the problem space for small operands (the generator's limit)."""
    return min(128, (max_operand + 1) ** 2 // 2)


def model_train_examples(steps: int, max_operand: int) -> list:
    """--model: the train questions both systems use, in order (stalerl with train_dataset.shuffle=false reads the
    same split from the start)."""
    from stalerl.data import load_examples

    return load_examples("synthetic", "train", synthetic_task="add", max_operand=max_operand,
                         train_size=PROMPTS * (steps + 2), test_size=synthetic_test_size(max_operand),
                         question_style="what_is")


def run_trl(steps: int, new_tokens: int, threads: int, model_dir: str | None = None, max_operand: int = 20,
            temperature: float = 1.0) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stalerl.data import load_examples
    from stalerl.core.model import PromptFormatter, build_char_tokenizer, build_tiny_model, load_policy
    from stalerl.core.reward import gsm8k_reward

    torch.set_num_threads(threads)
    if model_dir:
        # the same loader as stalerl's actor (float32, left padding, pad = eos when the tokenizer has none)
        model, tok = load_policy(model_dir, dtype="float32")
        examples = model_train_examples(steps, max_operand)
        prompts = [[{"role": "user", "content": e.question + INSTRUCTION}] for e in examples]
    else:
        tok = build_char_tokenizer()
        model = build_tiny_model("qwen2", tok, seed=SEED, **SHAPE)
        fmt = PromptFormatter(tok).format
        examples = load_examples("synthetic", "train", train_size=PROMPTS * (steps + 2))
        prompts = [fmt(e.question) for e in examples]
    data = Dataset.from_dict({"prompt": prompts, "answer": [e.final for e in examples]})
    rewards: list[float] = []

    def reward(prompts, completions, answer, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # conversational: messages
        out = [float(gsm8k_reward(t, a)) for t, a in zip(texts, answer)]
        rewards.append(statistics.fmean(out))  # one call per step (one generation batch per optimizer step)
        return out

    durations: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            durations.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                         generation_batch_size=PROMPTS * GROUP, max_completion_length=new_tokens,
                         temperature=temperature, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="grpo",
                         learning_rate=LR, shuffle_dataset=False,
                         adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                         lr_scheduler_type="constant", max_steps=steps, logging_steps=1, report_to="none",
                         save_strategy="no", use_cpu=True, seed=SEED, disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                              callbacks=[Clock()])
        trainer.train()
    return {"durations": durations, "rewards": rewards}


def run_stalerl(mode: str, engine: str, steps: int, new_tokens: int, threads: int, root: Path,
                warmup: int, model_dir: str | None = None, max_operand: int = 20,
                temperature: float = 1.0) -> dict:
    over = {
        "experiment_name": "bench", "seed": SEED, "warm_start.steps": 0, "total_train_steps": steps,
        "train_dataset.batch_size": PROMPTS, "train_dataset.shuffle": False,
        "train_dataset.synthetic.train_size": PROMPTS * (steps + 2), "gconfig.n_samples": GROUP,
        "gconfig.max_new_tokens": new_tokens, "gconfig.temperature": temperature,
        "eval_gconfig.max_new_tokens": new_tokens, "evaluator.freq_steps": "null",
        "evaluator.at_start": False, "recover.mode": "disabled", "saver.save_final": False, "actor.loss": "vanilla",
        "actor.optimizer.lr": LR, "actor.optimizer.weight_decay": 0.0, "actor.ppo_n_minibatches": 1,
        "rollout.fixed_staleness": 0, "rollout.backend": f"{engine}:d1", "stats_logger.tensorboard": False,
        "stats_logger.progress_bar": False, "stats_logger.mismatch_freq_steps": "null",
        "cluster.fileroot": str(root), "trial_name": mode,
    }
    if model_dir:  # the smollm2 example's chat prompt and instruction; the questions of model_train_examples
        config = REAL_CONFIG
        test_size = synthetic_test_size(max_operand)
        over.update({"actor.path": model_dir, "prompt.format": "chat", "actor.dtype": "float32",
                     "train_dataset.synthetic.task": "add", "train_dataset.synthetic.question_style": "what_is",
                     "train_dataset.synthetic.max_operand": max_operand,
                     "train_dataset.synthetic.test_size": test_size, "valid_dataset.synthetic.max_operand": max_operand,
                     "valid_dataset.synthetic.test_size": test_size, "evaluator.n_prompts": min(test_size, 128)})
    else:
        config = REPO / "examples/math/gsm8k_m2po_cpu.yaml"
        over.update({"actor.path": "tiny:qwen2", **{f"actor.tiny.{k}": v for k, v in SHAPE.items()}})
    if mode == "sync":
        over.update({"rollout.mode": "sync", "torch_threads": threads})
    else:  # d1 + d1: two processes share the thread budget
        over.update({"rollout.max_head_offpolicyness": 1, "torch_threads": max(1, threads // 2)})
    cmd = [sys.executable, str(REPO / "examples/math/gsm8k_rl.py"),
           "--config", str(config), *[f"{k}={v}" for k, v in over.items()]]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="ERROR")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"stalerl {mode} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / "bench" / mode / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r]
    parts = [k for k in ("timing/gen_s", "timing/wait_for_data_s", "timing/train_s", "timing/split/generation_s",
                         "timing/split/logp_s", "timing/split/forward_backward_s", "timing/split/optimizer_s",
                         "timing/weight_publish_s", "timing/weight_load_s") if k in rows[0]]
    steady = rows[warmup:] or rows
    print(f"  stalerl {mode}: median over the steady steps: " + ", ".join(
        f"{k.removeprefix('timing/')} {statistics.median(r[k] for r in steady):.2f}" for k in parts), flush=True)
    return {"durations": [r["timing/step_s"] for r in rows],
            "rewards": [r["reward/consumed"] for r in rows if "reward/consumed" in r]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="trl,sync,async")
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--warmup", type=int, default=5, help="first steps excluded (start-up, pipeline filling)")
    ap.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 64; with --model 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="medium", choices=sorted(SHAPES), help="model size (medium: ~27M parameters)")
    ap.add_argument("--model", help="a real model instead of the from-scratch one: a local Hugging Face directory or "
                                    "a known name (smollm2-135m-instruct; fetched once into $STALERL_CACHE)")
    ap.add_argument("--max-operand", type=int, default=20, help="--model: largest operand of the addition questions")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1; with --model "
                                                                    "0.7)")
    ap.add_argument("--trl-python", default=sys.executable,
                    help="interpreter with trl installed for the TRL run (e.g. the venv of scripts/ci_trl.sh), so "
                         "stalerl's runs can use the project's own environment")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    SHAPE.clear()
    SHAPE.update(SHAPES[args.shape])
    new_tokens = args.new_tokens if args.new_tokens is not None else (32 if args.model else 64)
    temperature = args.temperature if args.temperature is not None else (0.7 if args.model else 1.0)
    if args.child == "trl":
        print(json.dumps(run_trl(args.steps, new_tokens, args.threads, args.model, args.max_operand, temperature)))
        return
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    model_dir = None
    if args.model:
        from stalerl.core.model_store import resolve_model_path

        model_dir = os.path.abspath(os.path.expanduser(resolve_model_path(args.model)))
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            ap.error(f"--model {args.model!r}: {model_dir} is not a Hugging Face model directory (no config.json)")
        what = (f"model {model_dir} (chat template, what_is addition <= {args.max_operand}, "
                f"instruction {INSTRUCTION!r})")
    else:
        what = f"{args.shape} model"
    print(f"{what}, {PROMPTS} prompts x group {GROUP}, {new_tokens} new tokens, temperature {temperature}, "
          f"{args.steps} steps (first {args.warmup} excluded), {args.threads} threads, stalerl engine {args.engine}; "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    per_step: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root:
        for system in args.systems.split(","):
            if system == "trl":
                cmd = [args.trl_python, __file__, "--child", "trl", "--shape", args.shape, "--steps", str(args.steps),
                       "--new-tokens", str(new_tokens), "--threads", str(args.threads),
                       "--temperature", str(temperature), "--max-operand", str(args.max_operand)]
                if model_dir:
                    cmd += ["--model", model_dir]
                res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
                if res.returncode != 0:
                    raise RuntimeError(f"TRL failed:\n{res.stderr[-3000:]}")
                out = json.loads(res.stdout.strip().splitlines()[-1])
            else:
                out = run_stalerl(system, args.engine, args.steps, new_tokens, args.threads, Path(root), args.warmup,
                                  model_dir, args.max_operand, temperature)
            durations, rewards = out["durations"], out["rewards"]
            steady = durations[args.warmup:]
            per_step[system] = statistics.fmean(steady)
            start_up = ", ".join(f"{d:.2f}" for d in durations[:args.warmup])
            reward = f"{statistics.fmean(rewards):.3f}" if rewards else "n/a"
            print(f"{system:6s} steady {len(steady)} steps: mean s/step {per_step[system]:7.2f}, median "
                  f"{statistics.median(steady):7.2f}, reward mean (all {len(rewards)} steps) {reward}  "
                  f"(start-up steps: {start_up}; load average now {os.getloadavg()[0]:.1f})", flush=True)
    if "trl" in per_step:
        for system, s in per_step.items():
            if system != "trl":
                print(f"steps/s {system} / trl = {per_step['trl'] / s:.2f}x")


if __name__ == "__main__":
    main()
