"""M2PO in one file: the tiny model and one GRPO step, from prompts to the optimizer step, top to bottom.

    python examples/minimal/m2po_one_step.py

The runtime (stalerl.training) does exactly this with engines, queues, micro-batches and logs around it; here each
piece is a small function written plainly. tests/integration/test_minimal_example.py checks that, given the batch
the runtime sampled at its first step, these functions give its behaviour log-probs, rewards, advantages, loss and
gradients, and its weights after the optimizer step (and the same for a stale step, where M2PO masks tokens).

One step:
  1. prompts "Q: {question} A:", left-padded so every response starts at the same column;
  2. n responses per prompt, sampled token by token at temperature T, cut after the first eos;
  3. behaviour log-probs: log softmax(logits / T) of the sampled tokens under the sampling weights;
  4. rewards (the final number is right or not) and GRPO advantages (group mean / std);
  5. the trainer's log-probs (with grad), M2PO's mask (Algorithm 1 of arXiv 2510.01161) and loss;
  6. backward, gradient clipping, one AdamW step at the learning rate of the schedule.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional

import torch

from stalerl.core.model import load_policy
from stalerl.core.reward import gsm8k_reward
from stalerl.data import Example, generate_synthetic

# The values of examples/math/gsm8k_m2po_cpu.yaml and the config schema's defaults (stalerl/config/schema.py).
TEMPERATURE = 1.0  # gconfig.temperature
M2_THRESHOLD = 0.04  # actor.m2_threshold: tau, the largest mean d^2 the kept trust-region tokens may have
ADV_EPS = 1e-4  # actor.adv_norm.eps: keeps a group whose rewards are all equal at advantage 0 (0 / (0 + eps))
LOG_RATIO_CLAMP = 20.0  # d is clamped before exp() (verl's bound): exp(20) is already far outside any trust region
LR, BETAS, ADAM_EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.99), 1e-8, 0.0  # actor.optimizer
GRAD_CLIP = 1.0  # actor.optimizer.gradient_clipping (global norm)


@dataclass
class Rollout:
    """n responses per prompt. Row layout: [pad.. prompt | response ..pad]."""

    prompt_ids: torch.Tensor  # (N, P) int64, left-padded
    prompt_mask: torch.Tensor  # (N, P) bool
    response_ids: torch.Tensor  # (N, R) int64, pad after the first eos
    response_mask: torch.Tensor  # (N, R) bool: the sampled tokens up to and including the first eos
    group_ids: torch.Tensor  # (N,) int64: rows with the same id answer the same prompt


# ---------------------------------------------------------------------------------------------------- prompts
def encode_prompts(tokenizer, questions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The char model's prompt format, left-padded: all prompts end in the same column, so the responses form one
    block of columns and position t of every row predicts token t + 1."""
    ids = [tokenizer(f"Q: {q} A:", add_special_tokens=False)["input_ids"] for q in questions]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    prompt_mask = torch.tensor([[False] * (width - len(x)) + [True] * len(x) for x in ids])
    return prompt_ids, prompt_mask


def forward_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits of the last ``keep`` positions. Positions count real tokens only: with left padding, the first real
    token of every row is position 0 whatever its column (as transformers' generate numbers them)."""
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False,
                 logits_to_keep=keep).logits


# --------------------------------------------------------------------------------------------------- sampling
def mask_through_first_eos(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """True up to and including the first eos of each row (every token when there is none): the eos is part of
    the response (the policy chose to stop), what follows is not."""
    is_eos = (ids == eos_id).long()
    return (is_eos.cumsum(dim=1) - is_eos) == 0


@torch.no_grad()
def sample(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, n: int,
           max_new_tokens: int, temperature: float, eos_id: int, pad_id: int,
           generator: Optional[torch.Generator] = None) -> Rollout:
    """n responses per prompt from softmax(logits / T), one token at a time (no KV cache: a full forward per token
    is slow but plain, and the tiny model does not mind)."""
    model.eval()
    group_ids = torch.arange(prompt_ids.shape[0]).repeat_interleave(n)
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0)
    ids, mask = prompt_ids, prompt_mask
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = forward_logits(model, ids, mask, keep=1)[:, -1].float()
        token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator).squeeze(1)
        token = torch.where(done, torch.full_like(token, pad_id), token)  # a finished row only gets padding
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, ~done[:, None]], dim=1)
        done |= token == eos_id
        if bool(done.all()):
            break
    response_ids = ids[:, prompt_ids.shape[1]:]
    response_mask = mask_through_first_eos(response_ids, eos_id)
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_id))
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, group_ids)


# -------------------------------------------------------------------------------------------------- log-probs
def token_logprobs(model: torch.nn.Module, batch: Rollout, temperature: float) -> torch.Tensor:
    """(N, R) float32 log softmax(logits / T) of each response token, 0 on padding; differentiable.

    The temperature is part of the policy: the tokens were drawn from softmax(logits / T), so that is the
    distribution whose probabilities enter the importance ratio."""
    r = batch.response_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    # The last r + 1 positions: position t predicts token t + 1, so the r response tokens are predicted by the
    # first r of them (the last prompt token's and all but the last response token's). The prompt's logits are
    # never computed.
    logits = forward_logits(model, ids, mask, keep=r + 1)[:, :r].float()
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    return torch.where(batch.response_mask, logp, torch.zeros_like(logp))


@torch.no_grad()
def behaviour_logprobs(model: torch.nn.Module, batch: Rollout, temperature: float) -> torch.Tensor:
    """log pi_behaviour of the sampled tokens: the sampling weights' own probabilities (the runtime records them
    while sampling; one forward over the finished rows gives the same numbers up to float rounding)."""
    model.eval()
    return token_logprobs(model, batch, temperature)


# -------------------------------------------------------------------------------------- rewards and advantages
def compute_rewards(tokenizer, batch: Rollout, answers: list[str]) -> torch.Tensor:
    """(N,) 1.0 when the response's final number is the prompt's answer, else 0.0."""
    texts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(batch.response_ids, batch.response_mask)],
                                   skip_special_tokens=True)
    return torch.tensor([gsm8k_reward(t, answers[g]) for t, g in zip(texts, batch.group_ids.tolist())])


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor,
                    eps: float = ADV_EPS) -> torch.Tensor:
    """(N, R): (r - mean_group) / (std_group + eps) on every token of the response, 0 on padding. The group is
    the baseline: a response counts as good if it beat the other samples of its own prompt."""
    adv = torch.zeros_like(rewards)
    for g in group_ids.unique():
        rows = group_ids == g
        r = rewards[rows]
        mean = r.sum() / len(r)
        std = (((r - mean) ** 2).sum() / max(len(r) - 1, 1)).sqrt()  # unbiased (n - 1), as torch.std
        adv[rows] = (r - mean) / (std + eps)
    return torch.where(response_mask, adv[:, None], torch.zeros(()))


# ------------------------------------------------------------------------------------------------------ M2PO
def trust_region(d: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """T: the valid tokens whose ratio the update pushes further from 1 (A > 0 and d > 0, or A < 0 and d < 0).
    Strict: A = 0 (a group with equal rewards) or d = 0 (on-policy) is never in T."""
    return valid & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))


def m2po_keep_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
                   tau: float) -> torch.Tensor:
    """Algorithm 1, literally, with d = log pi_theta - log pi_behaviour: while the mean d^2 over T is above tau,
    mask the token of T with the largest d^2 (ties: the later token, row-major, goes first) and drop it from T.
    Only tokens of T are ever masked, and only as many as the batch's second moment demands: unlike PPO's clip, no
    token is cut for its own ratio alone, and the tokens moving back towards the behaviour policy keep their
    gradient."""
    d = log_ratio.detach().float()
    trust = trust_region(d, advantages, valid)
    d2 = (d * d).flatten().tolist()  # squared in float32, summed below in Python floats (float64)
    region = trust.flatten().nonzero().flatten().tolist()  # token indices of T, row-major
    keep = valid.flatten().clone()
    while region and sum(d2[i] for i in region) / len(region) > tau:
        worst = max(region, key=lambda i: (d2[i], i))
        region.remove(worst)
        keep[worst] = False
    return keep.view_as(valid)


def m2po_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
              tau: float = M2_THRESHOLD) -> tuple[torch.Tensor, dict[str, float]]:
    """-sum_valid(keep * A * exp(d)) / (number of ALL valid tokens): masked tokens stay in the denominator, so a
    masked token lowers the step instead of re-weighting the others. No epsilon clip."""
    d = torch.where(valid, logp.float() - old_logp.detach().float(), torch.zeros(()))
    keep = m2po_keep_mask(d, advantages, valid, tau)
    adv = torch.where(valid, advantages.detach().float(), torch.zeros(()))
    # Clamped with gradient: a kept token with |d| > 20 gets none (a straight-through one would weigh it by e^20).
    ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    per_token = torch.where(keep, -adv * ratio, torch.zeros_like(ratio))
    loss = per_token.sum() / valid.sum().clamp(min=1)
    with torch.no_grad():
        trust = trust_region(d, adv, valid)
        d2 = d.double() ** 2
        n_valid = max(int(valid.sum()), 1)
        stats = {"m2_before": float(d2[trust].mean()) if trust.any() else 0.0,
                 "m2_after": float(d2[trust & keep].mean()) if (trust & keep).any() else 0.0,
                 "masked_fraction": int((valid & ~keep).sum()) / n_valid, "loss": float(loss)}
    return loss, stats


# ---------------------------------------------------------------------------------------------------- update
def lr_factor(step: int, total_updates: int, warmup_proportion: float = 0.0, kind: str = "constant") -> float:
    """The learning-rate schedule (actor.optimizer.lr_scheduler_type): linear warm-up, then constant, linear decay
    or cosine decay to 0 at the last update."""
    warmup = int(round(warmup_proportion * total_updates))
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_updates - warmup))
    return {"constant": 1.0, "linear": 1.0 - progress,
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[kind]


def build_optimizer(model: torch.nn.Module, lr: float = LR) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=BETAS, eps=ADAM_EPS,
                             weight_decay=WEIGHT_DECAY)


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Rollout, old_logp: torch.Tensor,
           advantages: torch.Tensor, *, temperature: float = TEMPERATURE, tau: float = M2_THRESHOLD,
           grad_clip: float = GRAD_CLIP) -> dict[str, float]:
    """One optimizer step on the whole batch (one mini-batch, one micro-batch)."""
    model.train()  # the tiny model has no dropout, so train mode computes what eval mode computed for old_logp
    logp = token_logprobs(model, batch, temperature)
    loss, stats = m2po_loss(logp, old_logp, advantages, batch.response_mask, tau)
    loss.backward()
    # The global norm over all parameters; 0 means no clipping (the norm is still measured).
    stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                              grad_clip if grad_clip > 0 else float("inf")))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


# ------------------------------------------------------------------------------------------------------ demo
def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokenizer, picked: list[Example]) -> None:
    """One supervised step on the answers " #### N<eos>" (the runtime's warm_start section). A from-scratch model
    never answers right, so every GRPO group would have equal rewards, zero advantages and no gradient."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [e.question for e in picked])
    targets = [tokenizer(" #### " + e.final, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for e in picked]
    width = max(len(t) for t in targets)
    ids = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t in targets])
    batch = Rollout(prompt_ids, prompt_mask, ids, mask_through_first_eos(ids, tokenizer.eos_token_id),
                    torch.arange(len(picked)))
    model.train()
    loss = -token_logprobs(model, batch, 1.0).sum() / batch.response_mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(seed: int = 0, n_prompts: int = 8, n: int = 4, max_new_tokens: int = 8, sft_steps: int = 100,
         staleness: int = 16) -> dict[str, float]:
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # the tiny model gains nothing from more threads
    model, tokenizer = load_policy("tiny:qwen2", seed=seed)  # 0.54M-parameter Qwen2, char tokenizer, no download
    examples = generate_synthetic("add", "train", max_operand=9, train_size=2000, test_size=20)  # "3+5=?" -> 8
    sft = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    # A stale behaviour policy, as the runtime's rollout.fixed_staleness makes one: the batch is sampled by the
    # weights of `staleness` updates ago (supervised ones here), so d = log pi_theta - log pi_behaviour is not 0
    # and M2PO has something to mask. With staleness=0 the step is on-policy: d = 0, nothing is masked.
    behaviour = model
    for step in range(sft_steps):
        if step == sft_steps - staleness:
            behaviour = copy.deepcopy(model)
        sft_step(model, sft, tokenizer, [examples[int(i)] for i in torch.randint(len(examples) - n_prompts, (32,))])

    prompts = examples[-n_prompts:]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [e.question for e in prompts])
    batch = sample(behaviour, prompt_ids, prompt_mask, n=n, max_new_tokens=max_new_tokens, temperature=TEMPERATURE,
                   eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                   generator=torch.Generator().manual_seed(seed))
    old_logp = behaviour_logprobs(behaviour, batch, TEMPERATURE)
    rewards = compute_rewards(tokenizer, batch, [e.final for e in prompts])
    advantages = grpo_advantages(rewards, batch.group_ids, batch.response_mask)

    optimizer = build_optimizer(model)
    for group in optimizer.param_groups:  # the schedule's rate for update 0 of a 1-update run
        group["lr"] = LR * lr_factor(0, total_updates=1)
    stats = update(model, optimizer, batch, old_logp, advantages)
    stats["reward"] = float(rewards.mean())
    print(f"reward {stats['reward']:.3f} | M2 before {stats['m2_before']:.4f} after {stats['m2_after']:.4f} "
          f"(tau {M2_THRESHOLD}) | masked {stats['masked_fraction']:.3f} of {int(batch.response_mask.sum())} tokens "
          f"| loss {stats['loss']:.4f} | grad norm {stats['grad_norm']:.4f}")
    return stats


if __name__ == "__main__":
    main()
