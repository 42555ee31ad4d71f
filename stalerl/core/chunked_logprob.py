"""Per-token log-probs of a causal LM computed from its last hidden states, a chunk of tokens at a time, without
ever holding the (tokens, vocab) logits of a whole micro-batch (torch only).

``log softmax(h W^T / T)[id]`` for every token: the forward pass keeps, per token, only the log-prob and the
log-sum-exp; the backward pass recomputes one chunk's logits at a time from the saved hidden states and weight, as
fused linear-cross-entropy kernels do (Liger, Apple's cut-cross-entropy). The forward goes over chunks of tokens,
the backward over blocks of the vocabulary (all tokens x one block: each block's weight gradient is then written
once). Peak memory is tokens x hidden (the saved hidden states, which the model's own backward keeps anyway) plus
one chunk's logits (sized by device: :func:`chunk_elements_for`), instead of the plain path's tokens x vocab
logits, their fp32 copy and their gradient. The price is the logits matmul once more in the backward pass. Every op
in either pass has a shape fixed by the input shapes (no boolean-mask indexing, no ``.item()``), so on CUDA neither
pass waits for the device (tested under FakeTensorMode, which refuses data-dependent shapes).

Numerics follow the plain computation ``token_logprobs(lm_head(h), ids, T)`` under the ambient autocast, step by
step: the logits matmul runs in the autocast dtype (bf16 logits are rounded to bf16 as ``F.linear`` rounds them),
is cast to float32 and divided by the temperature, and the gradient reaching the logits is cast back to the compute
dtype before the two backward matmuls, as the autocast cast's backward does. In float32 values and gradients equal
the plain computation to float rounding (tests/unit/test_chunked_logprob.py: within 1e-5); in bf16 the one
difference is that the hidden-state gradient is accumulated block by block in float32 from bf16 block products
(the plain path rounds one full-size product to bf16), so each element differs by at most 2^-8 x the sum of the
absolute values of its terms (two roundings of partial sums bounded by that sum), tested.

:func:`head_returns_token_logprobs` plugs this into a Hugging Face causal LM without changing its code: for one
forward, the output-embedding module (``lm_head``) computes the log-probs of given target tokens from the hidden
states it receives instead of the logits, so the model's own forward (and FSDP2's hooks around it, which unshard
the head's weight for exactly that call) runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch

# Elements of one chunk's (tokens, vocab) logits on a CPU: 2^22 float32 = 16 MiB per temporary (a chunk holds a
# few), about 27 tokens at Qwen2's 151,936 vocabulary; small enough to stay near the caches, and the per-chunk matmul
# is already compute-bound at hidden 64 (bench/logprob_memory.py measures other sizes).
CHUNK_ELEMENTS = 1 << 22
# On CUDA each chunk is one (tokens x hidden) x (hidden x vocab) GEMM that streams the whole head weight from HBM, so
# few tokens per chunk make it bandwidth-bound (27 tokens: ~4,900 weight reads per pass of 131k tokens). The budget
# there is a fraction of the device's memory per float32 temporary (a chunk holds about three: compute-dtype logits,
# their float32 copy, the exp / gradient), capped where the GEMM is long compute-bound: 2^28 elements = 1 GiB per
# temporary, 1,766 tokens at vocab 151,936 (a 466 MB bf16 weight read per 1,766 tokens). 80-141 GB GPUs reach the
# cap (~3 GiB of temporaries); a 24 GiB GPU gets 101M elements (662 tokens), a 40 GiB one 1,104 tokens.
CUDA_MEMORY_FRACTION_PER_TEMPORARY = 1 / 64
CUDA_CHUNK_ELEMENTS_MAX = 1 << 28


def chunk_elements_for(device_type: str, total_memory_bytes: Optional[int] = None) -> int:
    """Elements of one chunk's logits on a device: :data:`CHUNK_ELEMENTS` on a CPU (and any device other than
    CUDA); on CUDA ``total_memory_bytes * CUDA_MEMORY_FRACTION_PER_TEMPORARY / 4`` capped at
    :data:`CUDA_CHUNK_ELEMENTS_MAX` and never below the CPU size. A pure function of its arguments (tested without
    a GPU); :func:`default_chunk_tokens` asks the device for its memory."""
    if device_type != "cuda":
        return CHUNK_ELEMENTS
    if not total_memory_bytes or total_memory_bytes <= 0:
        raise ValueError(f"chunk size on cuda needs the device's total memory in bytes, got {total_memory_bytes!r}")
    by_memory = int(total_memory_bytes * CUDA_MEMORY_FRACTION_PER_TEMPORARY) // 4
    return max(CHUNK_ELEMENTS, min(CUDA_CHUNK_ELEMENTS_MAX, by_memory))


def chunk_tokens_for(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // max(1, vocab))


@functools.lru_cache(maxsize=None)
def _cuda_total_memory(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).total_memory)


def default_chunk_elements(device: torch.device) -> int:
    """Elements of one chunk's logits for tensors on ``device`` (:func:`chunk_elements_for` with the device's
    memory). The one budget for every chunked log-prob pass: this module's, and the plain path's row chunks
    (``stalerl.training.actor.token_logprobs``)."""
    device = torch.device(device)
    memory = None
    if device.type == "cuda":
        memory = _cuda_total_memory(device.index if device.index is not None else torch.cuda.current_device())
    return chunk_elements_for(device.type, memory)


def default_chunk_tokens(device: torch.device, vocab: int) -> int:
    """Tokens per chunk for hidden states on ``device`` at this vocabulary (:func:`default_chunk_elements`)."""
    return chunk_tokens_for(vocab, default_chunk_elements(device))


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``F.linear`` would compute in here: the autocast dtype when autocast is on, else ``dtype``."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _ChunkedTokenLogprob(torch.autograd.Function):
    """hidden (M, H), weight (V, H), ids (M,) -> float32 log-probs (M,). Saves hidden, weight, ids and the
    per-token log-sum-exp; recomputes each chunk's logits in backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float,
                compute_dtype: torch.dtype, chunk: int) -> torch.Tensor:
        m = hidden.shape[0]
        out = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for s in range(0, m, chunk):
                x = _chunk_logits(hidden[s:s + chunk], w, compute_dtype, temperature)
                lse_c = torch.logsumexp(x, dim=-1)
                out[s:s + chunk] = x.gather(-1, ids[s:s + chunk].unsqueeze(-1)).squeeze(-1) - lse_c
                lse[s:s + chunk] = lse_c
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature, ctx.compute_dtype, ctx.chunk = temperature, compute_dtype, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # Chunked over the vocabulary (all tokens x one block of rows of W at a time): each block's weight gradient
        # is one matmul over all tokens, written once, and only the small (tokens, hidden) input gradient is
        # accumulated across blocks. (Chunking over tokens instead would add into the whole (vocab, hidden) weight
        # gradient once per chunk: at hidden 64 that memory traffic costs more than the matmuls.)
        hidden, weight, ids, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cd, t = ctx.compute_dtype, ctx.temperature
        m, vocab = hidden.shape[0], weight.shape[0]
        block = max(1, (ctx.chunk * vocab) // max(1, m))  # the same element budget as the forward's chunks
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        g = grad_out.float()
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(cd)
            for j in range(0, vocab, block):
                w = weight[j:j + block].to(cd)
                x = _chunk_logits(h, w, cd, t)
                # d logp / d x = onehot(id) - softmax(x); then through x = logits / t.
                grad_x = torch.exp(x - lse.unsqueeze(-1)).mul_(-g.unsqueeze(-1))
                # The one-hot term without a host sync: every row adds g (its target is in this block) or 0.0
                # (elsewhere) at a clamped in-block column. Fixed shapes, so no boolean-mask indexing (nonzero),
                # which would wait for the device once per block. Adding 0.0 leaves a value unchanged, and a
                # target's own element gets the same single addition as before, so the result is the same.
                local = ids - j
                inside = (local >= 0) & (local < w.shape[0])
                grad_x.scatter_add_(1, local.clamp(0, w.shape[0] - 1).unsqueeze(-1),
                                    torch.where(inside, g, zero).unsqueeze(-1))
                if t != 1.0:
                    grad_x.div_(t)
                # The plain path's gradient reaches the compute-dtype logits through their float32 cast: cast back.
                grad_logits = grad_x.to(cd)
                del x, grad_x
                if need_w:
                    grad_w[j:j + block] = (grad_logits.t() @ h).to(weight.dtype)
                if need_h:
                    if cd == torch.float32:
                        grad_h.addmm_(grad_logits, w)
                    else:
                        grad_h.add_(grad_logits @ w)
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None, None, None


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, compute_dtype: torch.dtype, temperature: float) -> torch.Tensor:
    x = (h.to(compute_dtype) @ w.t()).float()
    return x / temperature if temperature != 1.0 else x


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                           chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """``log softmax((hidden @ weight.T) / temperature)[ids]`` in float32, shape ``ids.shape``, computed
    ``chunk_tokens`` tokens at a time (default: :func:`default_chunk_tokens` for the device, :data:`CHUNK_ELEMENTS`
    logits per chunk on a CPU) in the ambient autocast
    dtype, with the chunks' logits recomputed in backward. ``hidden``: ``(*ids.shape, H)``; ``weight``: ``(V, H)``
    (a bias-free output embedding)."""
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match target ids {tuple(ids.shape)}: expected "
                         "hidden of shape (*ids.shape, hidden_size)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"output weight {tuple(weight.shape)} must be (vocab, {hidden.shape[-1]}) for hidden "
                         f"states of size {hidden.shape[-1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_tokens or default_chunk_tokens(hidden.device, weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_ids = ids.reshape(-1).to(device=hidden.device, dtype=torch.long)
    cd = _compute_dtype(hidden.device, torch.promote_types(hidden.dtype, weight.dtype))
    out = _ChunkedTokenLogprob.apply(flat_h, weight, flat_ids, float(temperature), cd, chunk)
    return out.view(ids.shape)


def output_head(model: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The model's bias-free linear output embedding, or None when it has none (then the plain path is used)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, torch.nn.Linear) and head.bias is None:
        return head
    return None


@contextlib.contextmanager
def head_returns_token_logprobs(model: torch.nn.Module, ids: torch.Tensor, columns: slice, temperature: float = 1.0,
                                chunk_tokens: Optional[int] = None) -> Iterator[None]:
    """Within the block, the model's output head maps the hidden states it receives, ``(N, K, H)``, to the float32
    log-probs ``(N, r)`` of ``ids`` (``(N, r)``) at hidden columns ``columns`` (r of the K), so ``model(...).logits``
    holds those log-probs. Patches the head module's ``forward`` on the instance and restores it on exit; the
    head's weight is read at call time, so a sharded (FSDP2) head gives its unsharded weight. Raises ValueError for
    a model without a bias-free linear head (check :func:`output_head` first)."""
    head = output_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no bias-free linear output embedding for chunked log-probs")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return chunked_token_logprobs(hidden[:, columns], head.weight, ids, temperature, chunk_tokens)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


@torch.no_grad()
def reproduces_plain_logprobs(model: torch.nn.Module, atol: float = 1e-4) -> bool:
    """Whether :func:`head_returns_token_logprobs` gives this model's plain log-probs (see
    :func:`chunked_logprob_check`, which also says why not)."""
    return chunked_logprob_check(model, atol)[0]


def chunked_logprob_check(model: torch.nn.Module, atol: float = 1e-4) -> tuple[bool, str]:
    """``(ok, reason)``: whether :func:`head_returns_token_logprobs` gives this model's plain log-probs: a bias-free
    linear head, and a forward that returns the head's output as the logits (no soft-capping or scaling after it).
    Checked once on a 4-token sequence in float32, before any sharding (the model's own code decides, so no list of
    model types). ``reason`` says why not (empty when ok): the actor logs it, since the fallback, the plain logits
    path, materialises (tokens x vocab) logits (multi-GB on a GPU at a 150k vocabulary)."""
    head = output_head(model)
    if head is None:
        return False, "the model has no bias-free linear output head the chunked path can replace"
    device = head.weight.device
    vocab = head.weight.shape[0]
    seq = (torch.arange(4, device=device) * 7 + 1).remainder(vocab).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        plain = torch.log_softmax(model(input_ids=seq, use_cache=False).logits[:, :3].float(), dim=-1)
        plain = plain.gather(-1, seq[:, 1:].unsqueeze(-1)).squeeze(-1)
        with head_returns_token_logprobs(model, seq[:, 1:], slice(0, 3)):
            chunked = model(input_ids=seq, use_cache=False).logits
    except Exception as exc:  # a model whose forward does something else with the head's output: use the plain path
        return False, f"the model's forward failed with the chunked head ({type(exc).__name__}: {exc})"[:300]
    finally:
        model.train(was_training)
    if chunked.shape != plain.shape:
        return False, f"the forward reshaped the head's output ({tuple(chunked.shape)} vs {tuple(plain.shape)})"
    diff = float((chunked.detach().float() - plain.detach()).abs().max())
    if diff > atol:
        return False, (f"the forward post-processes the head's output (chunked vs plain log-probs differ by {diff:.3g} "
                       f"> {atol:g}; e.g. logit soft-capping or scaling)")
    return True, ""
