"""The GPU check's long-sequence part (scripts/gpu_check.sh, part "long"): one training step at 4k and at 8k tokens
per row on Qwen2.5-1.5B's shape, with ``gsm8k_m2po.yaml``'s actor (bf16 autocast on fp32 weights, AdamW, no gradient
checkpointing, ``max_tokens_per_mb`` 8192, the chunked log-prob head, M2PO), random weights built on the device.

Rows longer than the ~1.5k tokens of the shipped task have not run on a GPU otherwise. Per length: the no-grad
log-prob pass (the behaviour log-probs), one ``Actor.update`` (forward + backward + AdamW), their times, the CUDA
allocator's peaks (allocated and reserved), whether the chunked head was used, loss and grad norm finite. Rows per
step: as many as fill one micro-batch (8192 tokens: 2 rows of 4096, 1 of 8192). Sizing: the estimate below against
the device's memory, so an H100 (78 GiB usable) and an H200 (139 GiB) both say where they stand:

    fp32 weights + gradients + AdamW moments   16 B x 1.54B parameters            23.0 GiB
    bf16 autocast copies of the weights         2 B x 1.54B                          2.9 GiB
    activations without checkpointing           3.3 MiB per token (docs/gpu.md)   26.4 GiB at 8192 tokens
    chunked head temporaries                    3 x 2^28 x 4 B (capped chunk)        3.0 GiB
                                                                                    ~55 GiB + transients

A length that runs out of memory is reported as failed with the allocator's message (and the next one still runs).
CPU dry mode: the CPU shape (hidden 64, 2 layers, vocab 4,096) at 256 and 512 tokens per row.

    python scripts/gpu_check_long.py --device cuda|cpu --out JSON [--tokens 4096,8192]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
TOKENS = {"cuda": (4096, 8192), "cpu": (256, 512)}
PROMPT = {"cuda": 512, "cpu": 32}  # prompt tokens of each row; the rest is response
GIB = 2 ** 30
ACTIVATION_BYTES_PER_TOKEN = 3.3 * 2 ** 20  # Qwen2.5-1.5B, bf16 autocast, no checkpointing (docs/gpu.md)


def estimate_gib(params: int, tokens_per_mb: int, chunk_elements: int) -> float:
    """The sizing above: states, autocast copies, activations of one micro-batch, chunked head temporaries."""
    return (16 * params + 2 * params + ACTIVATION_BYTES_PER_TOKEN * tokens_per_mb + 3 * chunk_elements * 4) / GIB


def _model(device: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(REPO / "scripts"))
    from smoke_assets import SHAPES, VOCAB_SIZE

    shape = dict(SHAPES["qwen2.5-1.5b" if device == "cuda" else "cpu"])
    if device != "cuda":
        shape["max_position_embeddings"] = 1024
    config = Qwen2Config(vocab_size=VOCAB_SIZE if device == "cuda" else 4096, tie_word_embeddings=True,
                         attn_implementation="sdpa", pad_token_id=0, eos_token_id=1, bos_token_id=None, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.float32)
    return model


def _batch(rows: int, prompt: int, response: int, vocab: int):
    import torch

    from stalerl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(rows * 7919 + response)
    n = rows
    return RolloutBatch(prompt_ids=torch.randint(2, vocab, (n, prompt), generator=g),
                        prompt_mask=torch.ones(n, prompt, dtype=torch.bool),
                        response_ids=torch.randint(2, vocab, (n, response), generator=g),
                        response_mask=torch.ones(n, response, dtype=torch.bool),
                        behavior_logp=torch.zeros(n, response), versions=torch.zeros(n, response, dtype=torch.long),
                        rewards=torch.zeros(n), group_ids=torch.arange(n))


def one_length(actor, device: str, tokens: int, vocab: int) -> dict[str, Any]:
    import torch

    per_mb = actor.max_tokens_per_mb
    rows = max(1, per_mb // tokens)
    prompt = PROMPT[device]
    batch = _batch(rows, prompt, tokens - prompt, vocab)
    out: dict[str, Any] = {"tokens_per_row": tokens, "rows": rows, "prompt_tokens": prompt}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:
        start = time.perf_counter()
        batch.behavior_logp = actor.compute_logp(batch)  # on-policy: the behaviour log-probs are the trainer's
        out["logp_s"] = time.perf_counter() - start
        adv = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).unsqueeze(1).expand(rows, tokens - prompt).clone()
        start = time.perf_counter()
        metrics = actor.update(batch, adv)
        if device == "cuda":
            torch.cuda.synchronize()
        out["step_s"] = time.perf_counter() - start
    except torch.cuda.OutOfMemoryError as exc:  # named, and the next length still runs
        out.update(ok=False, why=f"CUDA out of memory: {str(exc).splitlines()[0][:300]}")
        return out
    finally:
        if device == "cuda":
            out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        else:  # the process's peak RSS so far (Linux: KiB), an upper bound on this length's
            import resource

            out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    out["loss"], out["grad_norm"] = metrics.get("actor/loss"), metrics.get("actor/grad_norm")
    out["chunked_logprobs"] = bool(metrics.get("actor/chunked_logprobs"))
    out["micro_batches"] = metrics.get("actor/num_micro_batches")
    problems = [f"{k} = {out[k]!r}" for k in ("loss", "grad_norm")
                if not (isinstance(out[k], float) and math.isfinite(out[k]))]
    if not out["chunked_logprobs"]:
        problems.append("the chunked head was not used")
    out["ok"] = not problems
    if problems:
        out["why"] = "; ".join(problems)
    return out


def run(device: str, tokens: tuple[int, ...]) -> dict[str, Any]:
    import torch

    from stalerl.config import load_config
    from stalerl.core.chunked_logprob import default_chunk_elements
    from stalerl.training.actor import Actor

    overrides = ["--config", str(REPO / "examples/math/gsm8k_m2po.yaml"), f"actor.device={device}"]
    if device != "cuda":
        overrides += ["actor.mb_spec.max_tokens_per_mb=512"]
    cfg = load_config(overrides)
    model = _model(device)
    actor = Actor(model, cfg.actor, temperature=cfg.gconfig.temperature, total_updates=len(tokens))
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {"device": device, "parameters": params, "dtype": cfg.actor.dtype,
                              "gradient_checkpointing": bool(cfg.actor.gradient_checkpointing),
                              "max_tokens_per_mb": actor.max_tokens_per_mb,
                              "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "runs": []}
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        est = estimate_gib(params, actor.max_tokens_per_mb, default_chunk_elements(torch.device("cuda")))
        result.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=total, estimate_gib=est,
                      estimate_fits=est < 0.95 * total)
    for t in tokens:
        result["runs"].append(one_length(actor, device, t, model.config.vocab_size))
    result["problems"] = [f"{r['tokens_per_row']} tokens per row: {r.get('why')}" for r in result["runs"]
                          if not r.get("ok")]
    result["ok"] = not result["problems"]
    return result


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", default=None, help="tokens per row, comma-separated (default 4096,8192; CPU 256,512)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS[args.device]
    result = run(args.device, tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, args.out)
    print(f"gpu_check long rows ({args.device}, {result['parameters'] / 1e9:.3g}B parameters, "
          f"{result['max_tokens_per_mb']} tokens per micro-batch"
          + (f", estimate {result['estimate_gib']:.1f} of {result['gpu_memory_gib']:.1f} GiB" if "estimate_gib" in result
             else "") + "):")
    for r in result["runs"]:
        mem = f", peak allocated {r['peak_allocated_gib']:.2f} GiB" if "peak_allocated_gib" in r else ""
        print(f"  {r['rows']} x {r['tokens_per_row']} tokens: "
              + (f"log-probs {r['logp_s']:.3g} s, step {r['step_s']:.3g} s{mem}, chunked {r['chunked_logprobs']}"
                 if r.get("ok") else f"FAILED: {r.get('why')}{mem}"))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
