"""Generation tokens/s of the vLLM engine vs the HF engine on CPU, measured in one process on the same weights.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/vllm_throughput.py [--models tiny,medium]
        [--prompts 8] [--n 4] [--threads 2] [--repeats 2]

Models (built from scratch, char tokenizer, no download):
  tiny   = the embedded default (0.54M parameters), 10 new tokens, as in the CPU example;
  medium = Qwen2 hidden 512, 8 layers, MLP 1536 (~27M parameters), 256 new tokens, where batching should matter.
Each engine generates the same prompts x n samples (sampling at temperature 1); the first call of each engine is a
warm-up and not timed. Prints tokens/s per engine and the ratio vllm/hf (> 1: vLLM wins).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "tiny": (dict(), 10),
    "medium": (dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                    intermediate_size=1536, max_position_embeddings=512), 256),
}


def _options(threads: int):
    from types import SimpleNamespace

    return SimpleNamespace(dtype="float32", gpu_memory_utilization=0.1, kv_cache_memory_gb=None, max_model_len=None,
                           enforce_eager=True, tensor_parallel_size=1, enable_prefix_caching=False)


def _time(engine, questions, answers, n, new_tokens, repeats, **kw) -> tuple[float, int]:
    warm = {k: v[:2] for k, v in kw.items()}
    engine.generate(questions[:2], answers[:2], n_samples=n, max_new_tokens=new_tokens, **warm)  # warm-up
    rates, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        batch = engine.generate(questions, answers, n_samples=n, max_new_tokens=new_tokens, **kw)
        rates.append(batch.num_response_tokens / (time.perf_counter() - start))
        tokens = batch.num_response_tokens
    return statistics.median(rates), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch

    from stalerl.data import load_examples
    from stalerl.core.model import PromptFormatter, build_char_tokenizer, build_tiny_model
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine, sample_seeds

    torch.set_num_threads(args.threads)
    examples = load_examples("synthetic", "test", test_size=args.prompts)
    questions, answers = [e.question for e in examples], [e.final for e in examples]
    print(f"torch threads {args.threads}, {args.prompts} prompts x {args.n} samples, temperature 1")
    for name in args.models.split(","):
        shape, new_tokens = MODELS[name]
        tok = build_char_tokenizer()
        model = build_tiny_model("qwen2", tok, seed=0, **shape).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        fmt = PromptFormatter(tok).format
        hf = HFRolloutEngine(model, tok, fmt, gsm8k_reward)
        torch.manual_seed(0)
        hf_rate, hf_tokens = _time(hf, questions, answers, args.n, new_tokens, args.repeats)
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            vl = VLLMRolloutEngine(model, tok, fmt, gsm8k_reward, options=_options(args.threads), work_dir=Path(d),
                                   seed=0, max_num_seqs=args.prompts * args.n)
            vl.load_weights(model.state_dict(), version=0)
            startup = time.perf_counter() - start
            vl_rate, vl_tokens = _time(vl, questions, answers, args.n, new_tokens, args.repeats,
                                       seeds=sample_seeds(0, range(args.prompts), args.n))
            vl.close()
        print(f"{name:6s} {params:5.1f}M params, {new_tokens} new tokens: hf {hf_rate:8.1f} tok/s ({hf_tokens} tokens)"
              f" | vllm {vl_rate:8.1f} tok/s ({vl_tokens} tokens, engine start {startup:.1f}s)"
              f" | vllm/hf = {vl_rate / hf_rate:.2f}x", flush=True)


if __name__ == "__main__":
    main()
