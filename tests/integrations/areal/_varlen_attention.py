"""A CPU varlen attention for AReaL's packed micro-batches (test harness)."""

from __future__ import annotations

import contextlib


# AReaL's FSDP engine feeds the model packed micro-batches (sequences end to end, ``cu_seq_lens_q``/``_k`` in the
# forward kwargs) and relies on a varlen attention kernel (flash-attn on GPUs) to keep the sequences apart. With
# transformers' ``sdpa`` on CPU, the mask AReaL passes (``attention_mask={"full_attention": None}``) makes every token
# attend to the earlier sequences of its micro-batch, so log-probs would depend on the micro-batching. This is the
# CPU stand-in for the GPU kernel: causal attention within each packed sequence only. AReaL accepts only known
# ``attn_impl`` names, so it takes the place of transformers' "sdpa" while the tests run (:func:`varlen_sdpa_installed`);
# anything that is not a packed micro-batch (the references' padded forward) still goes to transformers' own sdpa.


def varlen_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or query.shape[0] != 1:  # not a packed micro-batch: plain sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    length = query.shape[2]
    positions = torch.arange(length, device=query.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(query.device), positions, right=True)
    allowed = (sequence[:, None] == sequence[None, :]) & (positions[None, :] <= positions[:, None])
    repeats = query.shape[1] // key.shape[1]  # grouped-query attention
    key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def varlen_sdpa_installed():
    """transformers' "sdpa" attention replaced by :func:`varlen_sdpa` inside the block."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa", varlen_sdpa)
    try:
        yield
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
