"""Supervised warm start on the data's worked answers, before RL.

A from-scratch tiny model never samples a correct answer, so every GRPO group would have zero reward variance and
no gradient. A short SFT phase (``warm_start.steps``; 0 disables it) brings sampled accuracy to ~15%, where RL has
signal. It is part of the config, logged, and skipped for real pretrained models by setting steps to 0.

Where a fixed step count ends depends on the machine (floating-point differences compound through the SFT steps; the
default run is mid-transition at 500 steps), so ``warm_start.target_accuracy`` > 0 makes the end point an accuracy
instead: greedy accuracy on held-out training-format problems, checked every ``eval_interval`` steps, with
``steps`` as the cap.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Optional, Sequence

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


def reached(accuracy: float, target: float) -> bool:
    """The adaptive stop rule: a check at or above the target stops the warm start."""
    return target > 0 and accuracy >= target


def warm_start(model: torch.nn.Module, tokenizer, format_prompt: Callable[[str], str],
               sft_target: Callable[[Any], str], examples: Sequence[Any], *, steps: int, batch_size: int, lr: float,
               seed: int, log: Callable[[str], None] = print, target_accuracy: float = 0.0, eval_interval: int = 50,
               accuracy: Optional[Callable[[], float]] = None) -> dict[str, float]:
    """Up to ``steps`` AdamW steps of completion-only cross-entropy; returns a summary for the run log.

    With ``target_accuracy`` > 0, ``accuracy()`` (greedy accuracy on held-out problems; it must not touch the RNG
    streams the loop uses) is checked every ``eval_interval`` steps and at the cap, and the loop stops at the first
    check at or above the target. With 0 no check runs and the loop is the fixed-step one, bit for bit.
    """
    if steps <= 0:
        return {"warm_start/steps": 0.0}
    adaptive = target_accuracy > 0
    if adaptive and accuracy is None:
        raise ValueError("warm_start: target_accuracy > 0 needs an accuracy() callback")
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    loss_value = float("nan")
    acc = float("nan")
    done = 0
    hit = False
    for step in range(steps):
        picked = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        batch = sft_batch(tokenizer, [format_prompt(e.question) for e in picked], [sft_target(e) for e in picked])
        loss = sft_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        done = step + 1
        checked = adaptive and (done % eval_interval == 0 or done == steps)
        if checked:
            acc = float(accuracy())
            model.train()  # the check generates in eval mode
            hit = reached(acc, target_accuracy)
        if done % 100 == 0 or done == steps or checked:
            extra = f", held-out greedy accuracy {acc:.3f} (target {target_accuracy:g})" if checked else ""
            log(f"warm start {done}/{steps}: loss {loss_value:.4f}{extra} ({time.perf_counter() - start:.1f}s)")
        if hit:
            break
    out = {"warm_start/steps": float(done), "warm_start/final_loss": loss_value,
           "warm_start/seconds": time.perf_counter() - start}
    if adaptive:
        out.update({"warm_start/cap": float(steps), "warm_start/target_accuracy": float(target_accuracy),
                    "warm_start/accuracy": acc, "warm_start/target_reached": 1.0 if hit else 0.0})
        if hit:
            log(f"warm start: target accuracy {target_accuracy:g} reached at step {done}/{steps} "
                f"(held-out greedy accuracy {acc:.3f})")
        else:
            log(f"WARNING: warm start hit its cap of {steps} steps before reaching target accuracy "
                f"{target_accuracy:g} (held-out greedy accuracy {acc:.3f}); RL starts from a weaker model than "
                "configured. Raise warm_start.steps or lower warm_start.target_accuracy.")
    return out
