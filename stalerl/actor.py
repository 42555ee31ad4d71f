"""The train worker's actor: per-token log-probs, micro-batching, the registered policy loss, one optimizer step
per mini-batch.

Exactness of splits. The loss aggregates with the mini-batch's global valid-token count (verl's
``global_batch_info``), so summing micro-batch gradients (and averaging across data-parallel ranks, each scaled by
``dp_size``) gives exactly the gradient of the whole mini-batch. A loss that selects tokens over the whole mini-batch
(M2PO) registers a batch selector: the actor runs it once per mini-batch (a no-grad forward pass over every
micro-batch first, when there is more than one micro-batch or rank) and hands each micro-batch its slice of the mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from recipe.registry import get_policy_loss_spec
from stalerl import fsdp
from stalerl.rollout.batch import RolloutBatch, position_ids_from_mask


@dataclass
class DataParallel:
    """Where this actor sits among the train workers (size 1: no process group)."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None


def build_optimizer(model: torch.nn.Module, opt_cfg: Any) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if opt_cfg.type == "adamw":
        return torch.optim.AdamW(params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                                 weight_decay=opt_cfg.weight_decay)
    if opt_cfg.type == "sgd":
        return torch.optim.SGD(params, lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    raise ValueError(f"actor.optimizer.type must be adamw or sgd, got {opt_cfg.type!r}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, opt_cfg: Any, total_updates: int):
    warmup = int(round(opt_cfg.warmup_steps_proportion * total_updates))
    kind = opt_cfg.lr_scheduler_type

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_updates - warmup))
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"actor.optimizer.lr_scheduler_type must be constant, linear or cosine, got {kind!r}")

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def loss_config(actor_cfg: Any) -> dict[str, Any]:
    """The keys the registered losses read (see recipe.common.cfg_get), from the runtime's actor config."""
    return {
        "m2_threshold": actor_cfg.m2_threshold,
        "m2_scope": "local",  # inside the loss call; the actor's batch selector covers the mini-batch (module doc)
        "eps_clip": actor_cfg.eps_clip,
        "eps_clip_higher": actor_cfg.eps_clip_higher,
        "c_clip": actor_cfg.c_clip,
        "global_batch_info": {},
    }


class Actor:
    def __init__(self, model: torch.nn.Module, actor_cfg: Any, *, temperature: float, total_updates: int,
                 dp: Optional[DataParallel] = None, loss_scale_factor: Optional[int] = None):
        self.model = model
        # seq-mean-token-sum-norm divides by a constant (verl's loss_scale_factor): the generation budget, never a
        # micro-batch's padded width, which would make the update depend on the split.
        self.loss_scale_factor = loss_scale_factor
        self.cfg = actor_cfg
        self.temperature = float(temperature)
        self.dp = dp or DataParallel()
        self.device = next(model.parameters()).device
        self.spec = get_policy_loss_spec(actor_cfg.loss)
        self.total_updates = max(1, total_updates)
        self.optimizer = build_optimizer(model, actor_cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, actor_cfg.optimizer, self.total_updates)
        self.sharded = False  # actor.backend=fsdp:dY after shard(): parameters are FSDP2 DTensor shards
        self._pending_optimizer_state: Optional[dict] = None  # a full checkpoint's, until shard() installs it
        self.max_tokens_per_mb = int(actor_cfg.mb_spec.max_tokens_per_mb)

    # ---------------------------------------------------------------- log-probs
    def _forward_logp(self, mb: RolloutBatch) -> torch.Tensor:
        input_ids = mb.input_ids().to(self.device)
        attn = mb.attention_mask().to(self.device)
        out = self.model(input_ids=input_ids, attention_mask=attn.long(), position_ids=position_ids_from_mask(attn),
                         use_cache=False)
        p = mb.prompt_ids.shape[1]
        r = mb.response_ids.shape[1]
        # logits at position t predict token t+1: the response tokens are predicted from columns p-1 .. p+r-2.
        logits = out.logits[:, p - 1:p + r - 1].float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, mb.response_ids.to(self.device).unsqueeze(-1)).squeeze(-1)

    def micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        """Consecutive rows packed while rows x padded width stays within max_tokens_per_mb (at least one row)."""
        prompt_len = batch.prompt_mask.sum(dim=1).tolist()
        resp_len = batch.response_mask.sum(dim=1).tolist()
        groups: list[list[int]] = []
        cur: list[int] = []
        p_max = r_max = 0
        for i in range(batch.num_rows):
            np_, nr = max(p_max, prompt_len[i]), max(r_max, resp_len[i])
            if cur and (len(cur) + 1) * (np_ + nr) > self.max_tokens_per_mb:
                groups.append(cur)
                cur, p_max, r_max = [], 0, 0
                np_, nr = prompt_len[i], resp_len[i]
            cur.append(i)
            p_max, r_max = np_, nr
        if cur:
            groups.append(cur)
        return groups

    @torch.no_grad()
    def compute_logp(self, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs of the batch's responses under the current weights (no grad), (N, R) on CPU, 0 on padding."""
        was_training = self.model.training
        self.model.eval()
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        micro = self.micro_batches(batch)
        for rows in micro:
            mb = batch.select(rows)
            lp = self._forward_logp(mb).cpu()
            out[rows, :lp.shape[1]] = torch.where(mb.response_mask, lp, torch.zeros_like(lp))
        for _ in range(self._missing_passes(len(micro))):
            fsdp.dummy_forward(self.model, self.device)
        self.model.train(was_training)
        return out

    def _missing_passes(self, n_micro: int) -> int:
        """Sharded model: forward passes this rank must add so every rank runs as many as the busiest one (each
        forward all-gathers the layers). 0 for a replicated model."""
        if not self.sharded or self.dp.size == 1:
            return 0
        return fsdp.max_over_ranks(n_micro, self.dp.group) - n_micro

    # ---------------------------------------------------------------- sharding (actor.backend=fsdp:dY)
    def shard(self, dtype: str = "float32", *, copy_model: bool = False,
              lr_scheduler_state: Optional[dict] = None, optimizer_state_follows: bool = False) -> None:
        """Shard the model over the data-parallel group with FSDP2 and rebuild the optimizer over the shards.

        Collective: every rank calls it at the same point, with the same ``optimizer_state_follows`` (rank 0 then
        broadcasts the full optimizer state a checkpoint gave it, see load_state_dict). ``copy_model``: shard a copy
        and leave ``self.model``'s original unsharded for the caller (rank 0 keeps it to evaluate, publish and
        save). The replicas must be identical before this (broadcast rank 0's weights first)."""
        if self.sharded:
            return
        import copy

        model = copy.deepcopy(self.model) if copy_model else self.model
        self.model = fsdp.shard_model(model, self.dp.size, dtype)
        self.device = next(self.model.parameters()).device
        self.sharded = True
        scheduler_state = lr_scheduler_state or self.lr_scheduler.state_dict()
        self.optimizer = build_optimizer(self.model, self.cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.cfg.optimizer, self.total_updates)
        self.lr_scheduler.load_state_dict(scheduler_state)
        if optimizer_state_follows:
            fsdp.load_full_optimizer_state(self.model, self.optimizer, self._pending_optimizer_state)
        self._pending_optimizer_state = None

    @property
    def has_pending_optimizer_state(self) -> bool:
        return self._pending_optimizer_state is not None

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Sharded: collective, the full weights on rank 0 (CPU) and {} elsewhere. Replicated: the local weights."""
        if self.sharded:
            return fsdp.full_model_state(self.model)
        return self.model.state_dict()

    # ---------------------------------------------------------------- update
    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp.size > 1:
            torch.distributed.all_reduce(t, group=self.dp.group)
        return t

    def update(self, batch: RolloutBatch, advantages: torch.Tensor,
               minibatch_sizes: Optional[list[int]] = None) -> dict[str, float]:
        """ppo_n_minibatches optimizer steps over the batch; returns step metrics (means over mini-batches).

        ``minibatch_sizes``: this rank's rows of each global mini-batch, in order (data parallelism: the controller
        cuts the batch into mini-batches first and shards each, so rank count cannot change the mini-batches)."""
        self.model.train()
        n_mini = int(self.cfg.ppo_n_minibatches)
        if minibatch_sizes is None:
            # Exactly n_mini mini-batches, even if some are empty: every data-parallel rank must take the same
            # number of optimizer steps (each one joins collectives).
            chunks = [c.tolist() for c in torch.tensor_split(torch.arange(batch.num_rows), n_mini)]
        else:
            if len(minibatch_sizes) != n_mini or sum(minibatch_sizes) != batch.num_rows:
                raise ValueError(f"minibatch_sizes {minibatch_sizes} must have {n_mini} entries summing to "
                                 f"{batch.num_rows} rows")
            bounds = [0]
            for size in minibatch_sizes:
                bounds.append(bounds[-1] + size)
            chunks = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        per_step: list[dict[str, float]] = []
        for chunk in chunks:
            per_step.append(self._update_minibatch(batch.select(chunk), advantages[chunk]))
        keys = set().union(*per_step)
        return {k: sum(m.get(k, 0.0) for m in per_step) / len(per_step) for k in sorted(keys)}

    def _update_minibatch(self, mini: RolloutBatch, adv: torch.Tensor) -> dict[str, float]:
        adv = adv[:, :mini.response_ids.shape[1]]
        micro = self.micro_batches(mini)
        totals = self._all_reduce_sum(torch.tensor([float(mini.num_response_tokens), float(mini.num_rows)],
                                                   dtype=torch.float64))
        cfg = loss_config(self.cfg)
        cfg["global_batch_info"] = {"dp_size": self.dp.size, "batch_num_tokens": int(totals[0]),
                                    "global_batch_size": int(totals[1]), "loss_scale_factor": self.loss_scale_factor}
        extra_full: dict[str, torch.Tensor] = {}
        selection_metrics: dict[str, float] = {}
        if self.spec.batch_selector is not None and (len(micro) > 1 or self.dp.size > 1):
            # One selection per mini-batch (no-grad forward over every micro-batch first), so splitting the
            # mini-batch into micro-batches or ranks cannot change which tokens are masked.
            current = self.compute_logp(mini)
            across_ranks = self.dp.size > 1 and self.cfg.m2_scope == "dp_group"
            selected = self.spec.batch_selector(mini.behavior_logp, current, adv, mini.response_mask, config=cfg,
                                                group=self.dp.group if across_ranks else None)
            selection = selected.pop("selection", None)
            if selection is not None:
                selection_metrics = selection.metrics()
            extra_full = selected

        loss_sum = 0.0
        metric_sums: dict[str, float] = {}
        sq_sum, n_tokens, max_abs = 0.0, 0.0, 0.0  # M2 over all valid tokens, for comparisons across losses
        for rows in micro:
            mb = mini.select(rows)
            width = mb.response_ids.shape[1]
            lp = self._forward_logp(mb)
            kwargs = {k: v[rows, :width].to(self.device) for k, v in extra_full.items()}
            loss, metrics = self.spec.fn(
                old_log_prob=mb.behavior_logp.to(self.device), log_prob=lp, advantages=adv[rows, :width].to(self.device),
                response_mask=mb.response_mask.to(self.device), loss_agg_mode=self.cfg.loss_agg_mode, config=cfg,
                rollout_is_weights=None, **kwargs)
            loss.backward()
            loss_sum += float(loss.detach())
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
            with torch.no_grad():
                d = torch.where(mb.response_mask, lp.detach().cpu() - mb.behavior_logp, torch.zeros(()))
                sq_sum += float((d * d).sum())
                n_tokens += float(mb.response_mask.sum())
                max_abs = max(max_abs, float(d.abs().max()) if d.numel() else 0.0)
        for _ in range(self._missing_passes(len(micro))):  # sharded: join the busiest rank's collectives
            fsdp.dummy_forward(self.model, self.device).backward()
        if self.dp.size > 1:
            if not self.sharded:  # FSDP2 has already averaged the gradients in its reduce-scatters
                # Flattened buckets, one all-reduce each; a rank with no rows joins with zero gradients.
                fsdp.all_reduce_gradients(self.model.parameters(), self.dp.group, self.dp.size)
            loss_t = self._all_reduce_sum(torch.tensor([loss_sum], dtype=torch.float64))
            loss_sum = float(loss_t[0]) / self.dp.size
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.gradient_clipping)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = {f"actor/{k}": v / max(1, len(micro)) for k, v in metric_sums.items()}
        out.update({f"actor/{k}": v for k, v in selection_metrics.items()})
        out["actor/loss"] = loss_sum
        out["actor/grad_norm"] = fsdp.to_float(grad_norm)
        out["actor/lr"] = float(self.lr_scheduler.get_last_lr()[0])
        out["actor/m2_all_tokens"] = sq_sum / max(1.0, n_tokens)
        out["actor/log_ratio_abs_max"] = max_abs
        out["actor/num_micro_batches"] = float(len(micro))
        return out

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Sharded: collective; the full state on rank 0 (optimizer keyed by parameter name), empty elsewhere."""
        if self.sharded:
            state = fsdp.full_state_dict(self.model, self.optimizer)
            state.update(lr_scheduler=self.lr_scheduler.state_dict(), format=fsdp.FULL_STATE_FORMAT)
            return state
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A full state (from either engine). A sharded checkpoint's optimizer state (keyed by name) is kept until
        shard() broadcasts it into the shards; loading one into an already sharded actor is a collective."""
        if state.get("format") == fsdp.FULL_STATE_FORMAT:
            if self.sharded:
                fsdp.load_full_model_state(self.model, state.get("model"))
                fsdp.load_full_optimizer_state(self.model, self.optimizer, state.get("optimizer"))
            else:
                self.model.load_state_dict(state["model"])
                self._pending_optimizer_state = state["optimizer"]
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
