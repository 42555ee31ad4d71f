"""ms-swift's HF GRPO trainer with the recipe losses: ``--loss_type m2po`` and ``--loss_type fipo_ref``.

A subclass of ``swift.rlhf_trainers.GRPOTrainer`` (ms-swift 4.6) that overrides only
``_compute_loss_and_metrics``, and only for this adapter's loss types; every other ``loss_type`` runs ms-swift's own
code unchanged. The plugin (:mod:`recipe.swift.plugin`) points ``TrainerFactory.TRAINER_MAPPING['grpo']`` here.

Exact at the optimizer step. HF's Trainer calls the loss once per gradient-accumulation micro-batch. ms-swift
generates once per ``steps_per_generation x num_iterations`` micro-steps and keeps the generation batch, already
split into micro-batches, in ``self._buffered_inputs``; micro-step k trains on ``_buffered_inputs[k %
steps_per_generation]``. So at an optimizer step's first micro-batch all of its micro-batches are known (refused
otherwise), and :func:`recipe.optimizer_batch.plan_optimizer_batch` makes, once per step,

- M2PO's Algorithm 1 selection over the whole step (all micro-batches, all processes), on the current policy's
  log-probs: the first micro-batch's come from its own training forward, the others from one no-grad forward each
  (skipped when the step is a single micro-batch on a single process, where the loss selects by itself);
- the denominator: the valid-token count of the step, all processes (not ms-swift's ``num_items_in_batch``, which
  counts the whole generation batch, more than one step when ``steps_per_generation > gradient_accumulation_steps``).

Each micro-batch's loss is ``sum(its per-token loss) / step tokens * dp_size``, multiplied by the accumulation steps
to undo HF's division, so the step's gradient is the one-call gradient of the whole step, whatever the split
(DDP averages over processes, hence ``dp_size``). The KL term (``--beta``) uses the same denominator.

Behaviour log-probs: the sampler's (``rollout_per_token_logps``, vLLM, when ms-swift collected them), else
ms-swift's ``old_per_token_logps`` (a no-grad forward of the policy that generated the batch), else on-policy.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.optimizer_batch import MicroBatch, OptimizerBatchPlan, plan_optimizer_batch
from recipe.registry import get_policy_loss_fn
from recipe.swift.config import LOSS_TYPES, check_swift_args, loss_config

try:
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer as SwiftGRPOTrainer
    from swift.trainers import disable_gradient_checkpointing
except ImportError as exc:  # pragma: no cover - exercised only without ms-swift
    raise ImportError(f"recipe.swift could not import ms-swift's GRPO trainer ({exc}). Fix: pip install "
                      "'stalerl[swift]' (ms-swift 4.6 and msgspec, which its GRPO trainer imports) in an environment "
                      "of its own (ms-swift pins trl<1.0); see docs/integrations/swift.md") from None


class GRPOTrainer(SwiftGRPOTrainer):
    """ms-swift's GRPOTrainer; ``loss_type`` ``m2po`` / ``fipo_ref`` use ``recipe.registry``'s losses exactly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs["args"]
        loss_type = getattr(training_args, "loss_type", None)
        self._recipe_loss_type: Optional[str] = loss_type if loss_type in LOSS_TYPES else None
        if self._recipe_loss_type is not None:
            check_swift_args(training_args)  # already run at argument parsing by the plugin; cheap, and safe
            self._recipe_config = loss_config(
                loss_type, epsilon_low=float(training_args.epsilon), epsilon_high=training_args.epsilon_high)
            self._recipe_fn = get_policy_loss_fn(LOSS_TYPES[loss_type])
        self._recipe_plan: Optional[tuple[OptimizerBatchPlan, list[Any]]] = None
        self._recipe_window_pos = 0
        super().__init__(*args, **kwargs)
        if self._recipe_loss_type is not None:
            self._recipe_check_runtime()

    # ------------------------------------------------------------------------------------------------ checks

    def _recipe_check_runtime(self) -> None:
        """Settings only known once ms-swift built the trainer (defaults it derived, multi-turn mode, teacher)."""
        name = self._recipe_loss_type
        if self.dynamic_num_samples:
            raise ValueError(f"--loss_type {name} does not support a variable number of samples per step "
                             "(multi-turn / dynamic rollouts). Fix: use a single-turn GRPO setup")
        if self._has_teacher_explicit():
            raise ValueError(f"--loss_type {name} does not support a teacher (OPD-RL). Fix: drop the teacher flags")
        if self.use_liger_loss:
            raise ValueError(f"--loss_type {name} does not support the Liger loss. Fix: drop --use_liger_kernel")
        spg = int(self.args.steps_per_generation)
        ga = int(self.args.gradient_accumulation_steps)
        if spg % ga != 0:
            raise ValueError(f"--loss_type {name} needs --steps_per_generation ({spg}) to be a multiple of "
                             f"--gradient_accumulation_steps ({ga}). Fix: set --steps_per_generation {ga}")

    # ------------------------------------------------------------------------------------------------ tensors

    def _recipe_valid_mask(self, grpo_batch: Any) -> torch.Tensor:
        """ms-swift's completion mask, minus truncated completions under ``--overlong_filter`` (as its losses do)."""
        mask = grpo_batch.completion_mask.bool()
        truncated = grpo_batch.truncated_mask
        if self.overlong_filter and truncated is not None and bool(truncated.any()):
            mask = mask & ~truncated.bool().unsqueeze(-1).expand_as(mask)
        return mask

    @staticmethod
    def _recipe_behaviour(grpo_batch: Any, current: torch.Tensor) -> torch.Tensor:
        if grpo_batch.rollout_per_token_logps is not None:
            return grpo_batch.rollout_per_token_logps
        if grpo_batch.old_per_token_logps is not None:
            return grpo_batch.old_per_token_logps
        return current.detach()

    def _recipe_group(self) -> Optional[Any]:
        if self.accelerator.num_processes > 1 and torch.distributed.is_initialized():
            return torch.distributed.group.WORLD
        return None

    def _recipe_accumulation_steps(self) -> int:
        return int(getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps)

    def _recipe_step_plan(self, model: Any, grpo_batch: Any, current: torch.Tensor) -> tuple[OptimizerBatchPlan, int]:
        """The step's plan and this micro-batch's index in it; computed at the step's first micro-batch."""
        window = self._recipe_accumulation_steps()
        pos = self._recipe_window_pos
        if pos == 0:
            self._recipe_plan = self._recipe_make_plan(model, grpo_batch, current, window)
        plan, batches = self._recipe_plan
        if pos >= len(batches) or batches[pos] is not grpo_batch:
            raise RuntimeError(f"recipe.swift: micro-batch {pos} of the optimizer step is not the one planned at the "
                               "step's start (ms-swift's batching changed?); the whole-step loss would be wrong")
        self._recipe_window_pos = (pos + 1) % window
        return plan, pos

    def _recipe_make_plan(self, model: Any, grpo_batch: Any, current: torch.Tensor,
                          window: int) -> tuple[OptimizerBatchPlan, list[Any]]:
        spg = int(self.args.steps_per_generation)
        generate_every = spg * int(self.num_iterations)
        step = int(self._step)
        if any((step + i) % generate_every == 0 for i in range(1, window)):
            raise RuntimeError(f"recipe.swift: optimizer step at micro-step {step} spans a new generation batch "
                               f"(steps_per_generation={spg}, accumulation={window}); its micro-batches are not known "
                               "in advance. Fix: --steps_per_generation a multiple of --gradient_accumulation_steps")
        entries = [self._buffered_inputs[(step + i) % spg] for i in range(window)]
        batches = [entry["grpo_batch"] for entry in entries]
        selects = self._recipe_selects(window)
        micro = []
        for i, entry in enumerate(entries):
            batch = batches[i]
            if i == 0:
                logps = current.detach()
            elif selects:
                with torch.no_grad(), disable_gradient_checkpointing(self.model,
                                                                     self.args.gradient_checkpointing_kwargs):
                    logps = self._get_per_token_logps_and_entropies(self.model, entry["model_inputs"], batch)[0]
            else:  # only the token count is needed: no forward
                logps = self._recipe_behaviour(batch, batch.completion_mask.float())
            micro.append(MicroBatch(self._recipe_behaviour(batch, logps), logps, batch.advantages,
                                    self._recipe_valid_mask(batch)))
        plan = plan_optimizer_batch(LOSS_TYPES[self._recipe_loss_type], micro, self._recipe_config,
                                    group=self._recipe_group())
        return plan, batches

    def _recipe_selects(self, window: int) -> bool:
        """Whether this loss needs the whole step's current log-probs (a batch-level selection over >1 call)."""
        from recipe.registry import get_batch_selector

        if get_batch_selector(LOSS_TYPES[self._recipe_loss_type]) is None:
            return False
        return window > 1 or self._recipe_group() is not None

    # ------------------------------------------------------------------------------------------------ loss

    def _recipe_policy_loss(self, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The registry loss on one micro-batch (a seam: the tests wrap it to capture what the loss received)."""
        return self._recipe_fn(**kwargs)

    def _compute_loss_and_metrics(self, model: Any, model_inputs: dict[str, Any], grpo_batch: Any):
        if self._recipe_loss_type is None:
            return super()._compute_loss_and_metrics(model, model_inputs, grpo_batch)
        training = self.model.training
        mode = "train" if training else "eval"
        if grpo_batch.teacher_per_token_logps is not None:  # a dataset `teacher_prompt` column turns on OPD-RL
            raise ValueError(f"--loss_type {self._recipe_loss_type} does not support teacher distillation (the dataset "
                             "has a `teacher_prompt` column). Fix: drop that column or use ms-swift's own loss types")
        per_token_logps, _ = self._get_per_token_logps_and_entropies(model, model_inputs, grpo_batch)
        mask = self._recipe_valid_mask(grpo_batch)
        if training:
            plan, pos = self._recipe_step_plan(model, grpo_batch, per_token_logps)
        else:  # evaluation: no optimizer step, the micro-batch alone
            plan, pos = plan_optimizer_batch(LOSS_TYPES[self._recipe_loss_type], [MicroBatch(
                self._recipe_behaviour(grpo_batch, per_token_logps), per_token_logps.detach(), grpo_batch.advantages,
                mask)], self._recipe_config, group=self._recipe_group()), 0
        config = plan.config_for(self._recipe_config)
        loss, metrics = self._recipe_policy_loss(
            old_log_prob=self._recipe_behaviour(grpo_batch, per_token_logps), log_prob=per_token_logps,
            advantages=grpo_batch.advantages, response_mask=mask, loss_agg_mode="token-mean", config=config,
            **plan.extras[pos])
        kl_mean = None
        if self.beta != 0.0 and not self.kl_in_reward:
            # ms-swift's k3 estimator, divided by the same whole-step token count as the policy loss
            log_ratio = torch.clamp(grpo_batch.ref_per_token_logps - per_token_logps, min=-20, max=20)
            per_token_kl = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
            kl_sum = torch.where(mask, per_token_kl, torch.zeros_like(per_token_kl)).sum()
            loss = loss + self.beta * kl_sum / max(plan.num_tokens, 1) * plan.dp_size
            kl_mean = (kl_sum / mask.sum().clamp(min=1)).detach()
        if training and not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
            loss = loss * self._recipe_accumulation_steps()  # HF's Trainer divides by it; the denominator is global
        if plan.selection is not None:  # M2PO: the whole step's selection, logged once per micro-batch
            metrics = {**metrics, **plan.selection.metrics()}
        for key, value in metrics.items():
            self._metrics[mode][key].append(float(value))
        metrics_data: dict[str, Any] = {"mode": mode, "entropy": {}, "completion_mask": mask,
                                        "completion_token_count": mask.sum().clamp(min=1)}
        if kl_mean is not None:
            metrics_data["kl"] = self.accelerator.gather_for_metrics(kl_mean).nanmean().item()
        return loss, metrics_data


__all__ = ["GRPOTrainer"]
