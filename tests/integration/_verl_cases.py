"""Synthetic micro-batches in verl's actor layout, for the verl plugin tests. Imports only torch at module level
(the rank worker imports this before verl, and must not import recipe before ``import verl``).

A case is a batch of B sequences, sequence i = prompt (p_i tokens) + response (r_i tokens). The model's output is a
flat vector over all prompt+response tokens (what verl's no-padding engines produce): position t of a sequence
holds log p(token t+1), so response token j of sequence i sits at ``offset_i + p_i - 1 + j``. The behaviour
log-probs and advantages are GRPO-like, with enough drift that M2PO masks some tokens at the thresholds used.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

try:
    VERL_AVAILABLE = importlib.util.find_spec("verl") is not None
except (ImportError, ValueError):
    VERL_AVAILABLE = False

#: The marks of every verl test module: the `verl` marker, skipped (with the install line) where verl is missing.
VERL_MARKS = [
    pytest.mark.verl,
    pytest.mark.skipif(not VERL_AVAILABLE, reason=(
        'verl is not installed: pip install "stalerl[verl]" -c <(echo torch==$(python -c '
        '"import torch;print(torch.__version__)"))')),
]

PROMPT_LENS = (5, 3, 7, 2, 4, 6, 1, 3)
RESPONSE_LENS = (16, 11, 7, 3, 13, 9, 16, 5)


def make_case(seed: int = 0, prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS) -> dict:
    g = torch.Generator().manual_seed(seed)
    bsz, width = len(response_lens), max(response_lens)
    mask = torch.arange(width)[None, :] < torch.tensor(response_lens)[:, None]
    old = -torch.rand(bsz, width, generator=g) * 2.0 - 0.05
    drift = torch.randn(bsz, width, generator=g) * 0.35
    new = old + drift
    adv = torch.randn(bsz, 1, generator=g).expand(bsz, width).clone()
    adv[0] = 1.0  # a few exact ties of A across rows, and one row with A == 0 (never in the trust region)
    adv[3] = 0.0
    # padding holds garbage, as engines leave it: it must not leak into the loss
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    adv = torch.where(mask, adv, torch.full_like(adv, 7.0))
    seq_lens = [p + r for p, r in zip(prompt_lens, response_lens)]
    offsets = [0]
    for n in seq_lens:
        offsets.append(offsets[-1] + n)
    flat = torch.randn(offsets[-1], generator=g) - 3.0  # prompt positions: arbitrary
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        flat[offsets[i] + p - 1: offsets[i] + p - 1 + r] = new[i, :r]
    prompt_ids = [torch.randint(10, 1000, (p,), generator=g) for p in prompt_lens]
    response_ids = [torch.randint(10, 1000, (r,), generator=g) for r in response_lens]
    return dict(prompt_lens=list(prompt_lens), response_lens=list(response_lens), mask=mask, old=old, new=new,
                adv=adv, flat=flat, offsets=offsets, prompt_ids=prompt_ids, response_ids=response_ids)


def flat_for_rows(case: dict, rows) -> torch.Tensor:
    """The model output (flat, all prompt+response tokens) of the given rows, in order."""
    off = case["offsets"]
    return torch.cat([case["flat"][off[i]:off[i + 1]] for i in rows]).clone()


def log_prob_from_flat(flat: torch.Tensor, case: dict, rows, width: int | None = None) -> torch.Tensor:
    """(len(rows), width) response log-probs sliced from ``flat`` (the output of ``rows``), zero-padded: the
    reference slicing, written independently of verl's ``no_padding_2_padding``."""
    width = width or max(case["response_lens"][i] for i in rows)
    out, pos = [], 0
    for i in rows:
        p, r = case["prompt_lens"][i], case["response_lens"][i]
        seg = flat[pos + p - 1: pos + p - 1 + r]
        out.append(torch.nn.functional.pad(seg, (0, width - r)))
        pos += p + r
    return torch.stack(out)


def model_output(flat: torch.Tensor, case: dict, rows, layout: str) -> dict:
    if layout == "nested":
        lens = torch.tensor([case["prompt_lens"][i] + case["response_lens"][i] for i in rows])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        return {"log_probs": torch.nested.nested_tensor_from_jagged(flat, offsets=offsets)}
    return {"log_probs": flat}


def build_td(case: dict, rows, layout: str, *, dp_size: int = 1, batch_num_tokens=None, global_batch_size=None):
    """verl's actor micro-batch (TensorDict) for ``rows``: ``padded`` (left-padded prompts, right-padded responses,
    integer attention_mask) or ``nested`` (jagged tensors, padded by ppo_loss to this micro-batch's longest
    response)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    rows = list(rows)
    n = len(rows)
    rlens = [case["response_lens"][i] for i in rows]
    if layout == "padded":
        width = case["mask"].shape[1]
        plen = max(case["prompt_lens"][i] for i in rows)
        prompts = torch.zeros(n, plen, dtype=torch.int64)
        responses = torch.zeros(n, width, dtype=torch.int64)
        attn = torch.zeros(n, plen + width, dtype=torch.int64)
        for k, i in enumerate(rows):
            p, r = case["prompt_lens"][i], case["response_lens"][i]
            prompts[k, plen - p:] = case["prompt_ids"][i]
            responses[k, :r] = case["response_ids"][i]
            attn[k, plen - p: plen] = 1
            attn[k, plen: plen + r] = 1
        td = TensorDict({
            "prompts": prompts, "responses": responses, "attention_mask": attn,
            "response_mask": case["mask"][rows].to(torch.int64),
            "old_log_probs": case["old"][rows], "advantages": case["adv"][rows],
        }, batch_size=[n])
    elif layout == "nested":
        def jag(tensors):
            return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)

        td = TensorDict({
            "prompts": jag(case["prompt_ids"][i] for i in rows),
            "responses": jag(case["response_ids"][i] for i in rows),
            "response_mask": jag(torch.ones(r, dtype=torch.int64) for r in rlens),
            "old_log_probs": jag(case["old"][i, :r] for i, r in zip(rows, rlens)),
            "advantages": jag(case["adv"][i, :r] for i, r in zip(rows, rlens)),
        }, batch_size=[n])
    else:
        raise ValueError(layout)
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                         global_batch_size=global_batch_size)
    return td


def num_tokens(case: dict, rows=None) -> int:
    rows = range(len(case["response_lens"])) if rows is None else rows
    return int(sum(case["response_lens"][i] for i in rows))
