"""End to end against TRL's GRPOTrainer on CPU, on stated and enforced equal work: seconds per optimizer step,
tokens/s and steps/s ratios against TRL, the systems alternated in one run.

    python bench/trl_vs_stalerl.py [--mode equal|shipped] [--dtype float32|bfloat16|default]
                                   [--gradient-checkpointing off|on] [--rounds 2] [--systems trl,sync,async]
                                   [--engine hf|vllm] [--steps 8] [--warmup 2] [--new-tokens 64]
                                   [--shape medium|small|tiny] [--trl-python PY]
    python bench/trl_vs_stalerl.py --model smollm2-135m-instruct|DIR [--new-tokens 32] [--max-operand 20] ...

Needs ``trl`` in the running environment or in ``--trl-python``'s (pip install "stalerl[trl]" in a venv of its
own, e.g. scripts/ci_trl.sh's). With ``--engine vllm`` stalerl's runs use rollout.backend=vllm:d1.

What each side runs is stated, and what matters is checked in the processes themselves rather than read from a
config (bench/_forward_dtype.py, loaded into every process of a measured run through bench/_probe_site):

- dtype: the dtype every nn.Linear matmul ran in (its output dtype, weighed by FLOPs), per phase (decode, no-grad
  prefill and decode inside generate, no-grad passes outside generate, training forward, recompute in backward;
  bench/_forward_dtype.py). A side whose claimed dtype has less than
  ``--min-dtype-share`` (0.75) of a phase's matmul FLOPs fails the run. bf16 = autocast on both sides: stalerl's
  actor.dtype=bfloat16 (generation, log-prob and training forwards), TRL's ``bf16=True`` (accelerate wraps the
  model's forward in autocast: generation included).
- sampling: the logits processors transformers' generate actually built (after merging the model's
  generation_config) and stalerl's engine arguments, and the first prompt of each side. The values both sides get
  are resolved once: the temperature is the task's (``--temperature``); top_k, top_p, min_p and the repetition
  penalty come from a flag, else the model's generation_config.json, else neutral (top_k 0, top_p 1, no min_p,
  penalty 1; never transformers' global top_k=50). ``--mode equal`` passes them explicitly to both and fails a side
  that sampled with anything else or saw another first prompt; ``--mode shipped`` prints what each side used.
- gradient checkpointing: forwards observed inside backward (recompute passes) must match the claim.
- passes per step: measured forward passes and tokens per phase; old log-probs recomputed (TRL: only when a batch
  is reused, num_iterations > 1 or steps_per_generation > gradient_accumulation_steps; stalerl:
  actor.behavior_logp=recompute) and a reference model (TRL beta > 0; stalerl has none) stated per side, and
  checked: a no-grad forward outside generate is such a pass, and a side that states none fails if one ran. With
  ``--mode equal`` a side whose training tokens per step (padding included) differ from TRL's by more than 1.5x
  fails.
- tokens generated (kept completion tokens, from each side's log) and trained (the training forward's tokens,
  padding included, from the probe) per step; the reward (stalerl.core.reward.gsm8k_reward in both).

Modes. ``shipped``: each side's defaults for everything the comparison is about: TRL's GRPOConfig defaults
(gradient_checkpointing=True, bf16=True unless ``--dtype`` sets it), stalerl's schema defaults (no gradient
checkpointing, float32 unless ``--dtype`` sets it); ``--dtype default`` keeps both sides' own dtype (TRL bf16,
stalerl float32). ``equal``: the same dtype, sampling, checkpointing (``--gradient-checkpointing``, off by default)
and passes (no old-log-prob pass, no reference model). In both: the same model, prompts in the same order (no
shuffling), group size, max new tokens, AdamW lr 1e-5 (``--lr``) betas (0.9, 0.99) no weight decay, clip 1.0,
constant lr, no KL term, one optimizer step per batch of 4 prompts x group 4, PPO-clip loss (TRL loss_type=grpo, stalerl
actor.loss=vanilla), stalerl's mismatch diagnostics off (stalerl's real-model example logs them every step: one
more no-grad pass). Threads: ``--threads`` (2) in all (TRL and stalerl sync: one process; stalerl async d1+d1: two
processes at half each).

Alternation: ``--rounds`` rounds, each running every system once for ``--steps`` optimizer steps (order reversed
every round: A B C, C B A, ...), the first ``--warmup`` steps of each run excluded (model start-up, the async
pipeline filling). Per system: mean s/step over all rounds' steady steps (and the median), kept generated tokens/s
and trained tokens/s; the steps/s ratio against TRL pooled over the rounds, with the per-round ratios' min /
median / max (bench/_alternation.py). The load average is printed with every run.

Setup: the from-scratch Qwen2 of bench/vllm_throughput.py "medium" (hidden 512, 8 layers, ~27M parameters, random
init with seed 1, char tokenizer; ``--shape small``: hidden 256, 4 layers, ~3.4M; ``tiny``: 0.54M), synthetic
addition prompts, temperature 1, 64 new tokens. ``--model`` (a local Hugging Face directory, or a known name such as
smollm2-135m-instruct, resolved with stalerl.core.model_store.resolve_model_path): that model in every system
(float32 weights; the compute dtype is ``--dtype``), with its own tokenizer and chat template. TRL gets
conversational prompts ``[{"role": "user", "content": question + " Answer with just the number."}]`` and applies the
chat template itself; stalerl runs examples/math/smollm2_add_grpo_cpu.yaml (prompt.format=chat, the same
instruction). Questions: the synthetic ``add`` task in the ``what_is`` style, operands <= ``--max-operand`` (20),
the same train split in both; temperature 0.7 by default, 32 new tokens, generation stopping at the tokenizer's eos
and the generation config's eos ids in both.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))
import _alternation as alt  # noqa: E402  (bench/ helpers: stdlib / torch only)

SHAPES = {
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                   intermediate_size=1536, max_position_embeddings=512),
    # ~3.4M parameters: for a steady-state run on a shared 2-core machine
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
TINY_CONFIG = REPO / "examples/math/gsm8k_m2po_cpu.yaml"
PROBE_SITE = BENCH / "_probe_site"
PROBE_DIR_ENV = "STALERL_BENCH_PROBE_DIR"  # = bench/_forward_dtype.PROBE_DIR_ENV (not imported: that needs torch)
DTYPES = ("float32", "bfloat16")
TOKENS_TOLERANCE = 1.5  # --mode equal: a side's training-forward tokens per step within this factor of TRL's


@dataclass(frozen=True)
class Side:
    """What one system runs, as stated (and then checked against the probe)."""

    dtype: str                  # the compute dtype of every forward (float32 / bfloat16)
    gradient_checkpointing: bool
    old_logp_pass: bool         # a no-grad pass recomputing the behaviour (old) log-probs
    reference_model: bool
    dtype_source: str           # where the dtype comes from ("--dtype", "TRL's default bf16=True", ...)
    checkpointing_source: str


def side_settings(mode: str, dtype: str, checkpointing: bool) -> dict[str, Side]:
    """The stated settings of each side ("trl", "stalerl") for a mode. ``dtype`` "default" is each side's own
    default (shipped only): TRL's GRPOConfig bf16=True, stalerl's actor.dtype float32."""
    if mode not in ("shipped", "equal"):
        raise ValueError(f"--mode must be shipped or equal, got {mode!r}")
    if dtype == "default" and mode != "shipped":
        raise ValueError("--dtype default (each side's own dtype) is for --mode shipped; --mode equal needs float32 "
                         "or bfloat16")
    if dtype not in (*DTYPES, "default"):
        raise ValueError(f"--dtype must be float32, bfloat16 or default, got {dtype!r}")
    given = dtype != "default"
    if mode == "shipped":
        return {
            "trl": Side(dtype if given else "bfloat16", True, False, False,
                        "--dtype (GRPOConfig bf16)" if given else "TRL's default: GRPOConfig bf16=True",
                        "TRL's default: GRPOConfig gradient_checkpointing=True"),
            "stalerl": Side(dtype if given else "float32", False, False, False,
                            "--dtype (actor.dtype)" if given else "stalerl's default: actor.dtype=float32",
                            "stalerl's default: actor.gradient_checkpointing=false"),
        }
    return {name: Side(dtype, checkpointing, False, False, "--dtype", "--gradient-checkpointing")
            for name in ("trl", "stalerl")}


def model_generation_config(model_dir: Optional[str]) -> dict:
    """The model's generation_config.json ({} for the from-scratch model or a model without one)."""
    if not model_dir:
        return {}
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


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


def run_trl(steps: int, new_tokens: int, threads: int, side: dict, sampling: dict, mode: str,
            model_dir: str | None = None, max_operand: int = 20, lr: float = LR) -> dict:
    """TRL's GRPOTrainer for ``steps`` optimizer steps (in the --child process). ``side``: asdict(Side);
    ``sampling``: the resolved sampling (passed explicitly with --mode equal; --mode shipped passes only the task's
    temperature and leaves the rest to GRPOConfig's defaults)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stalerl.data import load_examples
    from stalerl.core.model import PromptFormatter, build_char_tokenizer, build_tiny_model, load_policy
    from stalerl.core.reward import gsm8k_reward

    torch.set_num_threads(threads)
    if model_dir:
        # the same loader as stalerl's actor (float32 weights, left padding, pad = eos when the tokenizer has none)
        model, tok = load_policy(model_dir, dtype="float32")
        examples = model_train_examples(steps, max_operand)
        prompts = [[{"role": "user", "content": e.question + INSTRUCTION}] for e in examples]
    else:
        tok = build_char_tokenizer()
        model = build_tiny_model("qwen2", tok, seed=SEED, **SHAPE)
        fmt = PromptFormatter(tok).format
        examples = load_examples("synthetic", "train", train_size=PROMPTS * (steps + 2))
        prompts = [fmt(e.question) for e in examples]
    data = Dataset.from_dict({"prompt": prompts, "answer": [e.final for e in examples],
                              "question": [e.question for e in examples]})
    rewards: list[float] = []
    questions: list[list[str]] = []

    def reward(prompts, completions, answer, question, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # conversational: messages
        out = [float(gsm8k_reward(t, a)) for t, a in zip(texts, answer)]
        rewards.append(statistics.fmean(out))  # one call per step (one generation batch per optimizer step)
        questions.append(list(dict.fromkeys(question)))
        return out

    durations: list[float] = []
    gen_tokens: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            durations.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:  # kept completion tokens (up to and with the eos)
                gen_tokens.append(logs["completions/mean_length"] * PROMPTS * GROUP)

    extra = {}
    if mode == "equal" or side["dtype_source"].startswith("--dtype"):
        extra.update(bf16=side["dtype"] == "bfloat16", fp16=False)
    if mode == "equal":
        extra.update(gradient_checkpointing=side["gradient_checkpointing"], top_p=sampling["top_p"],
                     top_k=sampling["top_k"], min_p=sampling["min_p"],
                     repetition_penalty=sampling["repetition_penalty"])
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                         generation_batch_size=PROMPTS * GROUP, max_completion_length=new_tokens,
                         temperature=sampling["temperature"], beta=0.0, num_iterations=1, loss_type="grpo",
                         learning_rate=lr, shuffle_dataset=False,
                         adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                         lr_scheduler_type="constant", max_steps=steps, logging_steps=1, report_to="none",
                         save_strategy="no", use_cpu=True, seed=SEED, disable_tqdm=True, dataloader_num_workers=0,
                         **extra)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                              callbacks=[Clock()])
        stated = {"bf16": bool(cfg.bf16), "gradient_checkpointing": bool(cfg.gradient_checkpointing),
                  "num_iterations": cfg.num_iterations, "steps_per_generation": cfg.steps_per_generation,
                  "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "beta": cfg.beta,
                  "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p,
                  "repetition_penalty": cfg.repetition_penalty,
                  "old_logp_pass": cfg.num_iterations > 1 or cfg.steps_per_generation > cfg.gradient_accumulation_steps,
                  "reference_model": cfg.beta != 0.0}
        trainer.train()
    return {"durations": durations, "rewards": rewards, "gen_tokens": gen_tokens, "questions": questions[:1],
            "stated": stated}


def run_stalerl(system: str, engine: str, steps: int, new_tokens: int, threads: int, root: Path, side: Side,
                sampling: dict, mode: str, env: dict, model_dir: str | None = None, max_operand: int = 20,
                lr: float = LR) -> dict:
    trial = root.name
    over = {
        "experiment_name": "bench", "seed": SEED, "warm_start.steps": 0, "total_train_steps": steps,
        "train_dataset.batch_size": PROMPTS, "train_dataset.shuffle": False,
        "train_dataset.synthetic.train_size": PROMPTS * (steps + 2), "gconfig.n_samples": GROUP,
        "gconfig.max_new_tokens": new_tokens, "gconfig.temperature": sampling["temperature"],
        "eval_gconfig.max_new_tokens": new_tokens, "evaluator.freq_steps": "null",
        "evaluator.at_start": False, "recover.mode": "disabled", "saver.save_final": False, "actor.loss": "vanilla",
        "actor.optimizer.lr": lr, "actor.optimizer.weight_decay": 0.0, "actor.ppo_n_minibatches": 1,
        "rollout.fixed_staleness": 0, "rollout.backend": f"{engine}:d1", "stats_logger.tensorboard": False,
        "stats_logger.progress_bar": False, "stats_logger.mismatch_freq_steps": "null",
        "cluster.fileroot": str(root.parent), "trial_name": trial,
        "actor.dtype": side.dtype, "actor.gradient_checkpointing": side.gradient_checkpointing,
        "actor.behavior_logp": "recompute" if side.old_logp_pass else "rollout",
    }
    if mode == "equal":
        over.update({"gconfig.top_p": sampling["top_p"], "gconfig.top_k": sampling["top_k"]})
    if model_dir:  # the smollm2 example's chat prompt and instruction; the questions of model_train_examples
        config = REAL_CONFIG
        test_size = synthetic_test_size(max_operand)
        over.update({"actor.path": model_dir, "prompt.format": "chat",
                     "train_dataset.synthetic.task": "add", "train_dataset.synthetic.question_style": "what_is",
                     "train_dataset.synthetic.max_operand": max_operand,
                     "train_dataset.synthetic.test_size": test_size, "valid_dataset.synthetic.max_operand": max_operand,
                     "valid_dataset.synthetic.test_size": test_size, "evaluator.n_prompts": min(test_size, 128)})
    else:
        config = TINY_CONFIG
        over.update({"actor.path": "tiny:qwen2", **{f"actor.tiny.{k}": v for k, v in SHAPE.items()}})
    if system == "sync":
        over.update({"rollout.mode": "sync", "torch_threads": threads})
    else:  # d1 + d1: two processes share the thread budget
        over.update({"rollout.max_head_offpolicyness": 1, "torch_threads": max(1, threads // 2)})
    cmd = [sys.executable, str(REPO / "examples/math/gsm8k_rl.py"),
           "--config", str(config), *[f"{k}={v}" for k, v in over.items()]]
    res = subprocess.run(cmd, cwd=REPO, env=dict(env, VLLM_LOGGING_LEVEL="ERROR"), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"stalerl {system} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root.parent / "bench" / trial / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r]
    parts = [k for k in ("timing/gen_s", "timing/wait_for_data_s", "timing/train_s", "timing/split/generation_s",
                         "timing/split/logp_s", "timing/split/forward_backward_s", "timing/split/optimizer_s",
                         "timing/weight_publish_s", "timing/weight_load_s") if k in rows[0]]
    return {"durations": [r["timing/step_s"] for r in rows],
            "rewards": [r["reward/consumed"] for r in rows if "reward/consumed" in r],
            "gen_tokens": [r["response_length"] * PROMPTS * GROUP for r in rows if "response_length" in r],
            "split": {k.removeprefix("timing/"): [r[k] for r in rows] for k in parts}}


# ---------------------------------------------------------------------------------------------------------------------
# checking a run against its stated side


def check_run(who: str, side: Side, record: dict, min_share: float) -> list[str]:
    """Problems of one run against its stated side: the forward's dtype, the no-grad passes outside generation
    (old log-probs, reference model) and the gradient checkpointing."""
    from _forward_dtype import check_forward_dtype

    problems = [f"{who}: {p}" for p in check_forward_dtype(record["flops"], side.dtype, min_share)]
    nograd = record["passes"].get("nograd", 0)
    if not (side.old_logp_pass or side.reference_model) and nograd:
        problems.append(f"{who}: {nograd} no-grad forward passes outside generation (an old-log-prob, reference or "
                        "diagnostics pass) though none is stated")
    if (side.old_logp_pass or side.reference_model) and not nograd:
        problems.append(f"{who}: an old-log-prob or reference pass is stated but no no-grad forward ran outside "
                        "generation")
    recompute = record["passes"].get("recompute", 0)
    if side.gradient_checkpointing and recompute == 0:
        problems.append(f"{who}: gradient checkpointing claimed but no forward ran inside backward")
    if not side.gradient_checkpointing and recompute:
        problems.append(f"{who}: no gradient checkpointing claimed but {recompute} forward passes ran inside "
                        "backward")
    return problems


def per_step(record: dict, key: str, phase: str, steps: int) -> float:
    return record[key].get(phase, 0) / steps


def check_equal_tokens(trl: dict, other: dict, who: str, steps_trl: int, steps_other: int) -> list[str]:
    """--mode equal: the training-forward tokens per step of ``other`` within TOKENS_TOLERANCE of TRL's (padding
    included: a side training on far more padded positions does other work)."""
    a, b = per_step(trl, "tokens", "train", steps_trl), per_step(other, "tokens", "train", steps_other)
    if a <= 0 or b <= 0 or max(a, b) / min(a, b) > TOKENS_TOLERANCE:
        return [f"{who}: training-forward tokens per step {b:.0f} against TRL's {a:.0f} (more than "
                f"{TOKENS_TOLERANCE}x apart: not the same work)"]
    return []


def cpu_bf16_line() -> str:
    """What this CPU offers bf16 matmuls (on one without AMX or AVX512-BF16, bf16 runs slower than float32)."""
    import torch

    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or ["neither amx_bf16 nor avx512_bf16"]
    return (f"CPU: torch capability {torch.backends.cpu.get_cpu_capability()}, bf16 units: {', '.join(units)}; "
            f"torch {torch.__version__}")


def mean_or_nan(values: list) -> float:
    return statistics.fmean(values) if values else float("nan")


def first_prompt_text(model_dir: Optional[str], record: dict) -> Optional[str]:
    """The run's first prompt as text: stalerl's formatted prompt (PromptFormatter.format), else the first row
    transformers' generate saw, decoded (TRL applies the chat template itself). None when neither was seen."""
    if record.get("first_prompt_texts"):
        return record["first_prompt_texts"][0]
    if not record.get("first_prompts"):
        return None
    if model_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    else:
        from stalerl.core.model import build_char_tokenizer

        tok = build_char_tokenizer()
    return tok.decode(record["first_prompts"][0])


def describe_passes(record: dict, steps: int) -> str:
    """Measured forward passes (and their tokens) per optimizer step, per phase."""
    from _forward_dtype import PHASES

    parts = []
    for phase in PHASES:
        if record["passes"].get(phase):
            parts.append(f"{phase} {per_step(record, 'passes', phase, steps):.1f} x "
                         f"{record['tokens'][phase] / max(1, record['passes'][phase]):.0f} tok")
    return ", ".join(parts) or "none observed"


# ---------------------------------------------------------------------------------------------------------------------


def main() -> None:
    global SEED  # --seed: read by run_trl / run_stalerl (as SHAPE is)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="equal", choices=("equal", "shipped"),
                    help="equal: same dtype, sampling, checkpointing, passes; shipped: each side's defaults")
    ap.add_argument("--dtype", default="float32", choices=(*DTYPES, "default"),
                    help="compute dtype of every forward on both sides (bfloat16: autocast); default (--mode "
                         "shipped only): each side's own (TRL bf16, stalerl float32)")
    ap.add_argument("--gradient-checkpointing", default="off", choices=("off", "on"), help="--mode equal: both sides")
    ap.add_argument("--rounds", type=int, default=2, help="alternation rounds (each runs every system once)")
    ap.add_argument("--systems", default="trl,sync,async")
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (per system and round)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run excluded (start-up, pipeline)")
    ap.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 64; with --model 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="medium", choices=sorted(SHAPES), help="model size (medium: ~27M parameters)")
    ap.add_argument("--model", help="a real model instead of the from-scratch one: a local Hugging Face directory or "
                                    "a known name (smollm2-135m-instruct; fetched once into $STALERL_CACHE)")
    ap.add_argument("--max-operand", type=int, default=20, help="--model: largest operand of the addition questions")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1; with --model "
                                                                    "0.7, the smollm2 example's)")
    ap.add_argument("--top-k", type=int, default=None, help="default: the model's generation_config, else 0 (off)")
    ap.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config, else 1 (off)")
    ap.add_argument("--lr", type=float, default=LR, help="AdamW learning rate of both sides (> 0; 1e-12: the policy "
                                                         "does not move, so the rewards compare the sampling alone)")
    ap.add_argument("--seed", type=int, default=SEED, help="seed of both sides (sampling; the from-scratch model's "
                                                           "init). A fixed seed repeats the same draw in every run: "
                                                           "compare rewards over several seeds")
    ap.add_argument("--min-dtype-share", type=float, default=0.75,
                    help="least share of a phase's matmul FLOPs in the claimed dtype")
    ap.add_argument("--warn-only", action="store_true", help="print failed checks instead of stopping")
    ap.add_argument("--trl-python", default=sys.executable,
                    help="interpreter with trl installed for the TRL run (e.g. the venv of scripts/ci_trl.sh), so "
                         "stalerl's runs can use the project's own environment")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    SEED = args.seed
    SHAPE.clear()
    SHAPE.update(SHAPES[args.shape])
    new_tokens = args.new_tokens if args.new_tokens is not None else (32 if args.model else 64)
    if args.child == "trl":
        spec = json.loads(args.child_spec)
        print(json.dumps(run_trl(args.steps, new_tokens, args.threads, spec["side"], spec["sampling"],
                                 spec["mode"], args.model, args.max_operand, args.lr)))
        return
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not args.lr > 0:
        ap.error(f"--lr must be > 0 (stalerl's actor.optimizer.lr), got {args.lr}; use 1e-12 for a policy that does "
                 "not move")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not 0.0 < args.min_dtype_share <= 1.0:
        ap.error(f"--min-dtype-share must be in (0, 1], got {args.min_dtype_share}")
    if args.mode == "shipped" and args.gradient_checkpointing != "off":
        ap.error("--gradient-checkpointing is for --mode equal; --mode shipped keeps each side's default (TRL on, "
                 "stalerl off)")
    try:
        sides = side_settings(args.mode, args.dtype, args.gradient_checkpointing == "on")
    except ValueError as exc:
        ap.error(str(exc))
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in ("trl", "sync", "async")]
    if unknown or not systems:
        ap.error(f"--systems: unknown {unknown}; use a comma list of trl, sync, async")
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
    from _forward_dtype import resolve_sampling

    gen_cfg = model_generation_config(model_dir)
    # the task's temperature (the smollm2 example's 0.7) unless --temperature: a checkpoint's temperature is a chat
    # default, not this task's; its top_k / top_p / min_p / repetition_penalty do fill what no flag sets
    temperature = args.temperature if args.temperature is not None else (0.7 if args.model else 1.0)
    sampling = resolve_sampling(gen_cfg, temperature, args.top_k, args.top_p)
    if sampling["min_p"] is not None or sampling["repetition_penalty"] != 1.0:
        ap.error(f"the model's generation_config asks for min_p={sampling['min_p']} / repetition_penalty="
                 f"{sampling['repetition_penalty']}, which stalerl's engine does not apply; the comparison cannot "
                 "sample the same way (use a model directory without them)")
    print(f"{what}, {PROMPTS} prompts x group {GROUP}, {new_tokens} new tokens, {args.steps} steps per run (first "
          f"{args.warmup} excluded) x {args.rounds} rounds, {args.threads} threads, stalerl engine {args.engine}; "
          f"mode {args.mode}, seed {args.seed}, lr {args.lr:g}; load average at start {os.getloadavg()[0]:.1f}",
          flush=True)
    print(f"  {cpu_bf16_line()}", flush=True)
    print(f"  model generation_config.json: { {k: v for k, v in gen_cfg.items() if k != 'transformers_version'} }; "
          f"resolved sampling: {sampling}", flush=True)
    for name, side in sides.items():
        print(f"  {name:7s} stated: {side.dtype} ({side.dtype_source}); gradient checkpointing "
              f"{'on' if side.gradient_checkpointing else 'off'} ({side.checkpointing_source}); old-log-prob pass "
              f"{'yes' if side.old_logp_pass else 'no'}; reference model {'yes' if side.reference_model else 'no'}",
              flush=True)
    from _forward_dtype import check_sampling, effective_sampling, format_sampling, format_shares, read_records

    results: dict[str, list[dict]] = {s: [] for s in systems}
    prompts_seen: dict[str, str] = {}
    failures: list[str] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PROBE_SITE), str(REPO)]))
    with tempfile.TemporaryDirectory() as tmp:
        for rnd, system in alt.run_order(systems, args.rounds):
            probe = Path(tmp) / f"probe-{system}-{rnd}"
            probe.mkdir()
            run_env = dict(env, **{PROBE_DIR_ENV: str(probe)})
            side = sides["trl" if system == "trl" else "stalerl"]
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            if system == "trl":
                cmd = [args.trl_python, __file__, "--child", "trl", "--shape", args.shape, "--steps", str(args.steps),
                       "--new-tokens", str(new_tokens), "--threads", str(args.threads),
                       "--max-operand", str(args.max_operand), "--lr", repr(args.lr),
                       "--seed", str(args.seed),
                       "--child-spec", json.dumps({"side": asdict(side), "sampling": sampling, "mode": args.mode})]
                if model_dir:
                    cmd += ["--model", model_dir]
                res = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
                if res.returncode != 0:
                    raise RuntimeError(f"TRL failed:\n{res.stderr[-3000:]}")
                out = json.loads(res.stdout.strip().splitlines()[-1])
            else:
                out = run_stalerl(system, args.engine, args.steps, new_tokens, args.threads,
                                  Path(tmp) / f"{system}-{rnd}", side, sampling, args.mode, run_env, model_dir,
                                  args.max_operand, args.lr)
            record = read_records(probe)
            n = len(out["durations"])
            problems = check_run(f"{system} round {rnd}", side, record, args.min_dtype_share)
            if args.mode == "equal":
                problems += check_sampling(record, sampling, f"{system} round {rnd}")
            out.update(record=record, steps=n, load=(load_before, os.getloadavg()[0]),
                       wall=time.perf_counter() - t0)
            results[system].append(out)
            steady = alt.steady(out["durations"], args.warmup)
            split = ""
            if out.get("split"):
                split = "; stalerl median " + ", ".join(f"{k} {statistics.median(v[args.warmup:] or v):.2f}"
                                                         for k, v in out["split"].items())
            start_up = ", ".join(f"{d:.1f}" for d in out["durations"][:args.warmup])
            print(f"round {rnd} {system:5s}: {alt.seconds_per_step(steady):7.2f} s/step (median "
                  f"{statistics.median(steady):.2f}; start-up {start_up}), reward {mean_or_nan(out['rewards']):.3f}, "
                  f"run {out['wall']:.0f} s, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}{split}", flush=True)
            print(f"    rewards per step: {' '.join(f'{x:.2f}' for x in out['rewards'])}; matmul dtype: "
                  f"{format_shares(record['flops'])}", flush=True)
            print(f"    passes/step: {describe_passes(record, n)}", flush=True)
            print("    sampled with: " + " | ".join(format_sampling(s) + (" (greedy)" if s.get("greedy") else "")
                                                  for s in effective_sampling(record)), flush=True)
            if out.get("stated"):
                print(f"    TRL's config: {out['stated']}", flush=True)
            questions = (out.get("questions") or [[]])[0] or record.get("first_questions")
            if questions:
                print(f"    first step's questions: {questions}", flush=True)
            text = first_prompt_text(model_dir, record)
            if text is not None:
                print(f"    first prompt: {text!r}", flush=True)
                prompts_seen.setdefault(system, text)
                if args.mode == "equal" and "trl" in prompts_seen and text != prompts_seen["trl"]:
                    problems.append(f"{system} round {rnd}: first prompt {text!r} differs from TRL's "
                                    f"{prompts_seen['trl']!r}")
            for p in problems:
                print(f"    CHECK FAILED: {p}", flush=True)
            failures += problems
            if problems and not args.warn_only:
                sys.exit("stopped: the run did not do what its side states (--warn-only to go on):\n  "
                         + "\n  ".join(problems))
    print("\nsummary (steady steps of all rounds; tokens per step: kept generated tokens from each side's log, "
          "trained = training-forward tokens incl. padding, from the probe)", flush=True)
    trl_rounds = [alt.steady(r["durations"], args.warmup) for r in results.get("trl", [])]
    for system in systems:
        runs = results[system]
        rounds = [alt.steady(r["durations"], args.warmup) for r in runs]
        all_steady = [d for r in rounds for d in r]
        sps = alt.seconds_per_step(all_steady)
        gen = [g for r in runs for g in r["gen_tokens"][args.warmup:]]
        trained = sum(r["record"]["tokens"].get("train", 0) for r in runs) / sum(r["steps"] for r in runs)
        rewards = [x for r in runs for x in r["rewards"]]
        side = sides["trl" if system == "trl" else "stalerl"]
        line = (f"{system:5s} [{side.dtype}, checkpointing {'on' if side.gradient_checkpointing else 'off'}]: "
                f"{sps:7.2f} s/step (median {statistics.median(all_steady):.2f}, {len(all_steady)} steps), "
                f"generated {mean_or_nan(gen):.0f} tok/step = {mean_or_nan(gen) / sps:.1f} tok/s, trained "
                f"{trained:.0f} tok/step = {trained / sps:.0f} tok/s, reward {mean_or_nan(rewards):.3f}")
        if trl_rounds and system != "trl":
            per_round = alt.round_ratios([alt.seconds_per_step(r) for r in trl_rounds],
                                         [alt.seconds_per_step(r) for r in rounds])
            line += "; steps/s vs trl " + alt.format_ratio(alt.pooled_ratio(trl_rounds, rounds), per_round)
            trl_rewards, own = [r["rewards"] for r in results["trl"]], [r["rewards"] for r in runs]
            if all(trl_rewards) and all(own):
                diff, se, pairs = alt.paired_difference(trl_rewards, own)
                line += f"; reward - trl's, paired by step: {diff:+.3f} +- {se:.3f} (se, {pairs} steps)"
        print(line, flush=True)
    if args.mode == "equal" and "trl" in results:
        trl_rec = results["trl"][0]
        for system in systems:
            if system != "trl":
                failures += check_equal_tokens(trl_rec["record"], results[system][0]["record"], system,
                                               trl_rec["steps"], results[system][0]["steps"])
    if failures:
        print("checks failed:\n  " + "\n  ".join(failures), flush=True)
        if not args.warn_only:
            sys.exit(1)
    print(f"load average at the end {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
