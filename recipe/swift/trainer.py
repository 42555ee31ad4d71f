"""ms-swift's HF GRPO trainer with the recipe losses: every ``recipe.registry`` loss as a ``--loss_type`` (``m2po``,
``fipo_ref``, the baselines, plugins).

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

Behaviour log-probs: decided once per optimizer step for all its micro-batches and all ranks
(:func:`recipe.swift.config.behaviour_source`): vLLM's ``rollout_per_token_logps`` when every rank has them for
every micro-batch; with HF generation ms-swift's ``old_per_token_logps``; a step with rollout log-probs on only part
of it is refused, or, with ``STALERL_SWIFT_OLD_LOGPS_FALLBACK=true``, uses ``old_per_token_logps`` throughout and logs
``<loss>/behaviour_old_logps_fallback`` every step; under ``--async_generate`` without rollout log-probs it is refused.

The step window is :class:`recipe.hf_step.StepWindow` (shared with the TRL adapter); metrics follow
:class:`recipe.hf_step.StepMetrics` (whatever keys the loss returns, over the step's micro-batches and ranks by the
loss's declared rules, plus the plan's step-wide values, once per step).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipe.hf_step import StepMetrics, StepWindow, check_sharding_backend
from recipe.optimizer_batch import MicroBatch, OptimizerBatchPlan, plan_optimizer_batch
from recipe.registry import get_policy_loss_spec
from recipe.swift.config import (
    CURRENT,
    OLD,
    ROLLOUT,
    behaviour_source,
    check_swift_args,
    loss_config,
    old_logps_fallback,
    swift_loss_types,
)
from recipe.versions import check_framework_version

try:
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer as SwiftGRPOTrainer
    from swift.trainers import disable_gradient_checkpointing
except ImportError as exc:  # pragma: no cover - exercised only without ms-swift
    raise ImportError(f"recipe.swift could not import ms-swift's GRPO trainer ({exc}). Fix: pip install "
                      "'stalerl[swift]' (ms-swift 4.6 and msgspec, which its GRPO trainer imports) in an environment "
                      "of its own (ms-swift pins trl<1.0); see docs/integrations/swift.md") from None


class GRPOTrainer(SwiftGRPOTrainer):
    """ms-swift's GRPOTrainer; a ``loss_type`` of ``recipe.registry`` (``m2po``, ``fipo_ref``, ...) runs that loss,
    exact at the optimizer step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_framework_version("ms-swift", where="recipe.swift")
        training_args = kwargs["args"]
        loss_type = getattr(training_args, "loss_type", None)
        ours = swift_loss_types()
        self._recipe_loss_type: Optional[str] = loss_type if loss_type in ours else None
        self._recipe_loss: Optional[str] = ours.get(loss_type)  # its recipe.registry name
        if self._recipe_loss_type is not None:
            check_swift_args(training_args)  # already run at argument parsing by the plugin; cheap, and safe
            self._recipe_config = loss_config(
                loss_type, epsilon_low=float(training_args.epsilon), epsilon_high=training_args.epsilon_high)
            self._recipe_spec = get_policy_loss_spec(self._recipe_loss)
            self._recipe_fn = self._recipe_spec.fn
            self._recipe_old_fallback = old_logps_fallback()
        self._recipe_window = StepWindow("recipe.swift")
        self._recipe_metrics = StepMetrics()
        self._recipe_source = CURRENT  # the current step's behaviour source (decided at its first micro-batch)
        self._recipe_fell_back = False
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
        # accelerate's configuration can turn these on without a flag; only the built trainer knows
        check_sharding_backend("recipe.swift", f"--loss_type {name}",
                               deepspeed=bool(self.is_deepspeed_enabled),
                               fsdp=bool(self.is_fsdp_enabled))
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

    def _recipe_behaviour(self, grpo_batch: Any, current: torch.Tensor) -> torch.Tensor:
        """The behaviour log-probs of a micro-batch, from the source decided for its optimizer step."""
        if self._recipe_source == ROLLOUT:
            return grpo_batch.rollout_per_token_logps
        if self._recipe_source == OLD:
            return grpo_batch.old_per_token_logps
        return current.detach()

    def _recipe_decide_source(self, batches: list[Any]) -> None:
        """One behaviour source for the whole step: flags over its micro-batches, reduced over every rank."""
        rollout = [b.rollout_per_token_logps is not None for b in batches]
        old = [b.old_per_token_logps is not None for b in batches]
        flags = [float(all(rollout)), float(all(old)), -float(any(rollout))]  # min, min, -max
        group = self._recipe_group()
        if group is not None:
            t = torch.tensor(flags, dtype=torch.float32, device=self.accelerator.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
            flags = t.tolist()
        self._recipe_source, self._recipe_fell_back = behaviour_source(
            self._recipe_loss_type, every_rollout=flags[0] == 1.0, every_old=flags[1] == 1.0,
            any_rollout=flags[2] == -1.0, use_vllm=bool(getattr(self.args, "use_vllm", False)),
            async_generate=bool(getattr(self.args, "async_generate", False)),
            allow_old_fallback=self._recipe_old_fallback)

    def _recipe_group(self) -> Optional[Any]:
        if self.accelerator.num_processes > 1 and torch.distributed.is_initialized():
            return torch.distributed.group.WORLD
        return None

    def _recipe_accumulation_steps(self) -> int:
        return int(getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps)

    def _recipe_step_plan(self, model: Any, grpo_batch: Any, current: torch.Tensor) -> tuple[OptimizerBatchPlan, int]:
        """The step's plan and this micro-batch's index in it; computed at the step's first micro-batch."""
        return self._recipe_window.enter(
            int(self._step), grpo_batch, buffer=self._buffered_inputs, accumulation=self._recipe_accumulation_steps(),
            steps_per_generation=int(self.args.steps_per_generation), num_iterations=int(self.num_iterations),
            make_plan=lambda batches: self._recipe_make_plan(batches, current), pick=lambda entry: entry["grpo_batch"])

    def _recipe_make_plan(self, batches: list[Any], current: torch.Tensor) -> OptimizerBatchPlan:
        self._recipe_decide_source(batches)
        step = int(self._step)
        spg = int(self.args.steps_per_generation)
        selects = self._recipe_selects(len(batches))
        micro = []
        for i, batch in enumerate(batches):
            if i == 0:
                logps = current.detach()
            elif selects:  # as ms-swift computes its old log-probs: no grad, checkpointing off for the call
                entry = self._buffered_inputs[(step + i) % spg]
                with torch.no_grad(), disable_gradient_checkpointing(self.model,
                                                                     self.args.gradient_checkpointing_kwargs):
                    logps = self._get_per_token_logps_and_entropies(self.model, entry["model_inputs"], batch)[0]
            else:  # only the token count is needed: no forward
                logps = batch.completion_mask.float()
            micro.append(MicroBatch(self._recipe_behaviour(batch, logps).float(), logps.float(),
                                    batch.advantages.float(), self._recipe_valid_mask(batch)))
        return plan_optimizer_batch(self._recipe_loss, micro, self._recipe_config,
                                    group=self._recipe_group())

    def _recipe_selects(self, window: int) -> bool:
        """Whether this loss needs the whole step's current log-probs (a batch-level selection over >1 call)."""
        from recipe.registry import needs_step_log_probs

        # M2PO's batch selection and FIPO's row drops both decide from the step's current log-probs
        if not needs_step_log_probs(self._recipe_loss):
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
            self._recipe_decide_source([grpo_batch])
            plan, pos = plan_optimizer_batch(self._recipe_loss, [MicroBatch(
                self._recipe_behaviour(grpo_batch, per_token_logps).float(), per_token_logps.detach().float(),
                grpo_batch.advantages.float(), mask)], self._recipe_config, group=self._recipe_group()), 0
        config = plan.config_for(self._recipe_config)
        behaviour = self._recipe_behaviour(grpo_batch, per_token_logps)
        loss, metrics = self._recipe_policy_loss(
            old_log_prob=behaviour, log_prob=per_token_logps,
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
        self._recipe_log_metrics(mode, plan, pos, self._recipe_window.size if training else 1, mask, metrics)
        metrics_data: dict[str, Any] = {"mode": mode, "entropy": {}, "completion_mask": mask,
                                        "completion_token_count": mask.sum().clamp(min=1)}
        if kl_mean is not None:
            metrics_data["kl"] = self.accelerator.gather_for_metrics(kl_mean).nanmean().item()
        return loss, metrics_data


    def _recipe_log_metrics(self, mode: str, plan: OptimizerBatchPlan, pos: int, step_size: int,
                            mask: torch.Tensor, metrics: dict[str, Any]) -> None:
        """The loss's metrics of the whole optimizer step (all micro-batches, all ranks; the declared rules, then the
        plan's step-wide values), appended to ms-swift's ``_metrics`` once, at the step's last micro-batch; with the
        old-log-prob opt-in, whether this step used it."""
        acc = self._recipe_metrics
        if pos == 0:
            acc.add_plan(plan)
            if self._recipe_old_fallback:
                acc.add_constant(f"{self._recipe_loss}/behaviour_old_logps_fallback",
                                 1.0 if self._recipe_fell_back else 0.0)
        acc.add(mask, metrics)
        if pos == step_size - 1:
            for key, value in acc.reduce(self._recipe_spec.declaration.metrics, self._recipe_group()).items():
                self._metrics[mode][key].append(float(value))


__all__ = ["GRPOTrainer"]
