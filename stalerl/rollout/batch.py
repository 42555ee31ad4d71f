"""The unit of data between rollout and training: n sampled responses per prompt, padded, with per-token
behaviour log-probs and the weight version that generated each token.

Layout: prompts are left-padded to ``P`` columns and responses right-padded to ``R`` columns, so a row of
``input_ids`` is ``[pad.. prompt | response ..pad]`` with the response starting at column ``P`` for every row.
That keeps the response slice of the logits one contiguous block for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # (N, P) int64, left-padded with pad_id
    prompt_mask: torch.Tensor  # (N, P) bool
    response_ids: torch.Tensor  # (N, R) int64, right-padded with pad_id
    response_mask: torch.Tensor  # (N, R) bool: generated tokens up to and including the first eos
    behavior_logp: torch.Tensor  # (N, R) float32: log pi_behaviour(token) at the sampling temperature
    versions: torch.Tensor  # (N, R) int64: weight version that generated each token; -1 on padding
    rewards: torch.Tensor  # (N,) float32: raw task reward
    group_ids: torch.Tensor  # (N,) int64: rows with the same id answer the same prompt (GRPO group)
    texts: list[str] = field(default_factory=list)  # decoded responses, for logging
    answers: list[str] = field(default_factory=list)  # reference final answers
    # actor.behavior_logp=recompute: the engine's own sampling log-probs, kept beside the trainer's recompute (which
    # becomes behavior_logp, what the loss uses); rollout correction weighs the two. None: behavior_logp is the engine's.
    engine_logp: Optional[torch.Tensor] = None  # (N, R) float32

    @property
    def num_rows(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def set_trainer_logp(self, trainer_logp: torch.Tensor) -> None:
        """behavior_logp=recompute, in one place for the synchronous loop and the rollout workers: the trainer's
        log-probs at the generating weights become the behaviour log-probs, and the engine's are kept (engine_logp)."""
        if self.engine_logp is None:
            self.engine_logp = self.behavior_logp
        self.behavior_logp = trainer_logp

    def head_versions(self) -> torch.Tensor:
        """Oldest version among each row's tokens (a row with no tokens gets its max, i.e. -1)."""
        big = torch.iinfo(torch.int64).max
        v = torch.where(self.response_mask, self.versions, torch.full_like(self.versions, big))
        head = v.min(dim=1).values
        return torch.where(head == big, torch.full_like(head, -1), head)

    def select(self, rows: torch.Tensor | slice | list[int]) -> "RolloutBatch":
        """Rows of the batch, trimmed to the columns those rows use."""
        if isinstance(rows, list):
            rows = torch.tensor(rows, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[rows]
            elif isinstance(value, list) and value:
                idx = range(len(value))[rows] if isinstance(rows, slice) else rows.tolist()
                out[f.name] = [value[i] for i in idx]
            else:
                out[f.name] = list(value) if isinstance(value, list) else value
        return RolloutBatch(**out).trimmed()

    def trimmed(self) -> "RolloutBatch":
        """Drop prompt columns that are padding in every row and response columns past the longest response."""
        if self.num_rows == 0:
            return self
        p_keep = int(self.prompt_mask.any(dim=0).nonzero().min()) if self.prompt_mask.any() else self.prompt_mask.shape[1]
        r_len = int(self.response_mask.sum(dim=1).max())
        return RolloutBatch(
            prompt_ids=self.prompt_ids[:, p_keep:], prompt_mask=self.prompt_mask[:, p_keep:],
            response_ids=self.response_ids[:, :r_len], response_mask=self.response_mask[:, :r_len],
            behavior_logp=self.behavior_logp[:, :r_len], versions=self.versions[:, :r_len],
            rewards=self.rewards, group_ids=self.group_ids, texts=self.texts, answers=self.answers,
            engine_logp=None if self.engine_logp is None else self.engine_logp[:, :r_len],
        )

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return RolloutBatch(**{f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                                        else getattr(self, f.name)) for f in fields(self)})

    def state(self) -> dict[str, Any]:
        """Plain dict (CPU tensors) for checkpoints and inter-process transport."""
        return {f.name: (getattr(self, f.name).cpu() if isinstance(getattr(self, f.name), torch.Tensor)
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "RolloutBatch":
        return cls(**state)


def _pad_to(t: torch.Tensor, width: int, value: Any, left: bool) -> torch.Tensor:
    missing = width - t.shape[1]
    if missing <= 0:
        return t
    pad = torch.full((t.shape[0], missing), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1) if left else torch.cat([t, pad], dim=1)


def concat_batches(batches: list[RolloutBatch], pad_id: int, *, renumber_groups: bool = True) -> RolloutBatch:
    """Concatenate rows of several batches, re-padding to a common width; group ids stay distinct."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    p = max(b.prompt_ids.shape[1] for b in batches)
    r = max(b.response_ids.shape[1] for b in batches)
    offset = 0
    groups = []
    for b in batches:
        g = b.group_ids
        if renumber_groups:
            uniq, inv = torch.unique(g, return_inverse=True)
            g = inv + offset
            offset += int(uniq.numel())
        groups.append(g)
    return RolloutBatch(
        prompt_ids=torch.cat([_pad_to(b.prompt_ids, p, pad_id, True) for b in batches]),
        prompt_mask=torch.cat([_pad_to(b.prompt_mask, p, False, True) for b in batches]),
        response_ids=torch.cat([_pad_to(b.response_ids, r, pad_id, False) for b in batches]),
        response_mask=torch.cat([_pad_to(b.response_mask, r, False, False) for b in batches]),
        behavior_logp=torch.cat([_pad_to(b.behavior_logp, r, 0.0, False) for b in batches]),
        versions=torch.cat([_pad_to(b.versions, r, -1, False) for b in batches]),
        rewards=torch.cat([b.rewards for b in batches]),
        group_ids=torch.cat(groups),
        texts=[t for b in batches for t in b.texts],
        answers=[a for b in batches for a in b.answers],
        # kept only when every part has it (a mix of recomputed and engine-only batches cannot be corrected as one)
        engine_logp=(torch.cat([_pad_to(b.engine_logp, r, 0.0, False) for b in batches])
                     if all(b.engine_logp is not None for b in batches) else None),
    )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as HF generate does with left padding."""
    pos = attention_mask.long().cumsum(dim=1) - 1
    return pos.clamp(min=0)


@dataclass
class PackedRows:
    """A micro-batch's rows as one padding-free row (``actor.mb_spec.pack_sequences``): each row's real tokens
    (prompt, then response) back to back, position ids restarting at 0 per row, so transformers' masking utilities
    (``find_packed_sequence_indices``) keep attention within each row when no attention mask is passed.

    The response tokens to score are listed flat, in row-major order of ``response_mask``: ``target_ids[k]`` sits at
    ``(rows[k], cols[k])`` of the padded response layout and is predicted by the model's output at packed column
    ``predictor[k]`` (the token before it in the same row)."""

    input_ids: torch.Tensor  # (1, L) int64
    position_ids: torch.Tensor  # (1, L) int64
    predictor: torch.Tensor  # (M,) int64: packed columns whose outputs predict the targets
    target_ids: torch.Tensor  # (M,) int64
    rows: torch.Tensor  # (M,) int64
    cols: torch.Tensor  # (M,) int64

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack_rows(batch: RolloutBatch) -> PackedRows:
    """``batch``'s real tokens (attention mask true) as one row; see :class:`PackedRows`. Position ids count each
    row's real tokens, as :func:`position_ids_from_mask` does for the padded layout, so a row sees the same
    positions and (its own) context either way. Raises ValueError for a row with response tokens but no prompt
    token: its first response token has no predecessor to be predicted from."""
    attn = batch.attention_mask()
    width = attn.shape[1]
    flat = attn.reshape(-1)
    keep = flat.nonzero().squeeze(1)
    input_ids = batch.input_ids().reshape(-1)[keep].unsqueeze(0)
    positions = position_ids_from_mask(attn).reshape(-1)[keep].unsqueeze(0)
    packed_index = flat.long().cumsum(0) - 1  # packed column of each real (row, column) of the padded layout
    rows, cols = batch.response_mask.nonzero(as_tuple=True)
    target = packed_index[rows * width + batch.prompt_ids.shape[1] + cols]
    if rows.numel() and bool((positions[0, target] == 0).any()):
        bad = int(rows[positions[0, target] == 0][0])
        raise ValueError(f"pack_rows: row {bad} has response tokens but no prompt token, so its first response "
                         "token has nothing to be predicted from; every row needs a non-empty prompt")
    return PackedRows(input_ids=input_ids, position_ids=positions, predictor=target - 1,
                      target_ids=batch.response_ids[rows, cols], rows=rows, cols=cols)
