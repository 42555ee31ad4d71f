"""How much GPU memory a vLLM rollout engine asks for (``rollout.vllm.gpu_memory_utilization=null`` on CUDA).

vLLM reserves ``gpu_memory_utilization x total`` for itself: the weights, its activation peak, and a KV cache made
of whatever is left. A sequence that does not fit in the KV cache is preempted (its KV dropped and recomputed later),
which costs time but also changes nothing we could detect, so the default is sized to hold every sequence the run
can have in flight at its full length: ``max_num_seqs`` sequences of (longest prompt + longest completion) tokens.

    needed = weights + overhead + KV,   KV = max_num_seqs x round_up(seq_len, block) x kv_bytes_per_token
    gpu_memory_utilization = needed / total device memory, rounded up to 0.01

``overhead`` is a generous allowance for what vLLM measures when it profiles a forward pass (activations of one
scheduler step, the sampler's fp32 logits and their log-softmax for ``max_num_seqs`` rows, CUDA graphs, the CUDA
context): more than vLLM uses leaves a larger KV cache than needed, never a smaller one. The rest of the GPU stays
with the trainer (the synchronous loop shares one GPU between the two). docs/gpu.md works the numbers through for the
shipped gsm8k_m2po.yaml (Qwen2.5-1.5B) on an 80 GB GPU.

Pure arithmetic on a Hugging Face config: no torch, no vLLM, so it is tested on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

GIB = 1 << 30
KV_BLOCK_TOKENS = 16  # vLLM's default block size: a sequence holds whole blocks
BASE_OVERHEAD_BYTES = 4 * GIB  # activations of a 16k-token step, CUDA graphs, CUDA context and workspaces
SAMPLER_LOGIT_COPIES = 4  # fp32 logits, their temperature-scaled and log-softmax copies, and a gather buffer
MAX_UTILIZATION = 0.9  # vLLM's own default; more leaves no room for the CUDA context of anything else
MIN_UTILIZATION = 0.05
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class VLLMMemoryPlan:
    utilization: float  # the gpu_memory_utilization to pass
    weights_bytes: int
    overhead_bytes: int
    kv_bytes: int  # the KV cache every in-flight sequence at full length needs
    kv_tokens: int
    total_bytes: int
    capped: bool  # the need exceeded MAX_UTILIZATION: some sequences may be preempted

    def describe(self) -> str:
        return (f"gpu_memory_utilization={self.utilization:.2f} of {self.total_bytes / GIB:.1f} GiB: weights "
                f"{self.weights_bytes / GIB:.2f} GiB + overhead {self.overhead_bytes / GIB:.2f} GiB + KV cache for "
                f"{self.kv_tokens:,} tokens {self.kv_bytes / GIB:.2f} GiB"
                + (" (capped: some sequences may be preempted)" if self.capped else ""))


def kv_bytes_per_token(model_config: Any, dtype: str) -> int:
    """Key and value vectors of every layer for one token: layers x 2 x kv_heads x head_dim x bytes."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return model_config.num_hidden_layers * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def plan_gpu_memory(*, model_config: Any, n_params: int, dtype: str, max_num_seqs: int, max_seq_len: int,
                    total_bytes: int) -> VLLMMemoryPlan:
    """The utilization that holds ``max_num_seqs`` sequences of ``max_seq_len`` tokens without preemption."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"vLLM dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    width = DTYPE_BYTES[dtype]
    weights = n_params * width
    overhead = BASE_OVERHEAD_BYTES + max_num_seqs * model_config.vocab_size * 4 * SAMPLER_LOGIT_COPIES
    kv_tokens = max_num_seqs * KV_BLOCK_TOKENS * math.ceil(max_seq_len / KV_BLOCK_TOKENS)
    kv = kv_tokens * kv_bytes_per_token(model_config, dtype)
    need = (weights + overhead + kv) / total_bytes
    utilization = math.ceil(need * 100) / 100
    capped = utilization > MAX_UTILIZATION
    utilization = min(MAX_UTILIZATION, max(MIN_UTILIZATION, utilization))
    return VLLMMemoryPlan(utilization=utilization, weights_bytes=weights, overhead_bytes=overhead, kv_bytes=kv,
                          kv_tokens=kv_tokens, total_bytes=total_bytes, capped=capped)


def round_up_to_block(tokens: int) -> int:
    """``tokens`` rounded up to whole KV blocks (a sequence holds whole blocks, so a shorter limit saves nothing)."""
    return KV_BLOCK_TOKENS * math.ceil(tokens / KV_BLOCK_TOKENS)


def planned_seq_len(cfg: Any, model_max_len: int, longest_prompt: Optional[int] = None) -> int:
    """The longest sequence a run puts in flight, rounded up to whole KV blocks, never more than vLLM's max_model_len.

    The prompt part is the tightest bound known: the prompt cap (the larger of train_dataset.max_length and
    valid_dataset.max_length, the engine evaluating too; none when either is null) and ``longest_prompt``, the
    longest formatted prompt of the run's train and valid data in tokens (vllm_engine.longest_prompt_tokens), when
    measured; the model's length when neither is known. Plus the longest completion (training or evaluation). It is
    also rollout.vllm.max_model_len's default (vllm_engine.resolve_max_model_len): SmolLM2's ~50-token prompts + 16
    new tokens plan 80 tokens, not the model's 8,192 (whose KV cache would not fit vLLM-CPU's default 0.25 GiB)."""
    limit = cfg.rollout.vllm.max_model_len or model_max_len
    caps = (cfg.train_dataset.max_length, cfg.valid_dataset.max_length)
    bounds = [b for b in (None if any(c is None for c in caps) else max(caps), longest_prompt) if b is not None]
    prompt = min(bounds) if bounds else limit
    new = max(cfg.gconfig.max_new_tokens, cfg.eval_gconfig.max_new_tokens)
    return min(limit, round_up_to_block(prompt + new))
