"""Supervised warm start on the data's worked answers, before RL.

A from-scratch tiny model never samples a correct answer, so every GRPO group would have zero reward variance and
no gradient. A short SFT phase (``warm_start.steps``; 0 disables it) brings sampled accuracy to ~15%, where RL has
signal. It is part of the config, logged, and skipped for real pretrained models by setting steps to 0.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

import torch

from stalerl.rollout.batch import RolloutBatch, position_ids_from_mask


def sft_batch(tokenizer, prompts: Sequence[str], targets: Sequence[str]) -> RolloutBatch:
    """Prompts left-padded, targets (+eos) right-padded, in the same layout as rollouts."""
    tokenizer.padding_side = "left"
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    target_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in targets]
    width = max(len(t) for t in target_ids)
    resp = torch.full((len(targets), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(targets), width), dtype=torch.bool)
    for i, ids in enumerate(target_ids):
        resp[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = True
    n = len(targets)
    return RolloutBatch(prompt_ids=enc["input_ids"], prompt_mask=enc["attention_mask"].bool(), response_ids=resp,
                        response_mask=mask, behavior_logp=torch.zeros(resp.shape), versions=torch.zeros_like(resp),
                        rewards=torch.zeros(n), group_ids=torch.arange(n))


def sft_loss(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    device = next(model.parameters()).device
    input_ids = batch.input_ids().to(device)
    attn = batch.attention_mask().to(device)
    logits = model(input_ids=input_ids, attention_mask=attn.long(), position_ids=position_ids_from_mask(attn),
                   use_cache=False).logits
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1:p + r - 1].float(), dim=-1)
    tok = logp.gather(-1, batch.response_ids.to(device).unsqueeze(-1)).squeeze(-1)
    mask = batch.response_mask.to(device)
    return -torch.where(mask, tok, torch.zeros_like(tok)).sum() / mask.sum().clamp(min=1)


def warm_start(model: torch.nn.Module, tokenizer, format_prompt: Callable[[str], str],
               sft_target: Callable[[Any], str], examples: Sequence[Any], *, steps: int, batch_size: int, lr: float,
               seed: int, log: Callable[[str], None] = print) -> dict[str, float]:
    """``steps`` AdamW steps of completion-only cross-entropy; returns a summary for the run log."""
    if steps <= 0:
        return {"warm_start/steps": 0.0}
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(steps):
        picked = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        batch = sft_batch(tokenizer, [format_prompt(e.question) for e in picked], [sft_target(e) for e in picked])
        loss = sft_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"warm start {step + 1}/{steps}: loss {loss_value:.4f} ({time.perf_counter() - start:.1f}s)")
    return {"warm_start/steps": float(steps), "warm_start/final_loss": loss_value,
            "warm_start/seconds": time.perf_counter() - start}
