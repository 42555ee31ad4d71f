"""``GRPOTrainer``: TRL's GRPOTrainer whose ``recipe.registry`` losses are exact at the optimizer step.

How TRL 1.16 feeds an optimizer step: ``_prepare_inputs`` generates once per ``steps_per_generation x
num_iterations`` micro-steps, shuffles the rows and keeps ``steps_per_generation`` micro-batches in
``self._buffered_inputs``; micro-step ``k`` trains on ``_buffered_inputs[k % steps_per_generation]``. With
``steps_per_generation`` a multiple of ``gradient_accumulation_steps`` (checked by GRPOConfig), all micro-batches of
a step are in that buffer when its first one is trained. So at a step's first micro-batch this trainer

1. reads the step's micro-batches from the buffer, computes their current log-probs without grad (only for M2PO with
   behaviour log-probs: on-policy the log-ratio is 0 and Algorithm 1 keeps everything),
2. plans the step with :func:`recipe.optimizer_batch.plan_optimizer_batch`: M2PO's Algorithm 1 once over every
   micro-batch (and every process), and the step's valid-token count (all processes),

and every micro-batch's loss is then the registry's loss with that selection and that denominator: the micro-batch
losses add up to the whole step's token-mean loss, whatever the split (TRL's GRPOTrainer sets
``loss_is_scaled_for_ga``, so HF adds no division; DDP's gradient mean is undone by ``dp_size``).

The step window is :class:`recipe.hf_step.StepWindow` (shared with the ms-swift adapter). The extra no-grad forwards
run as TRL's own old-log-prob forward does: model in the mode the trainer left it, ``torch.no_grad()`` and TRL's
``disable_gradient_checkpointing``. Metrics follow :class:`recipe.hf_step.StepMetrics`: whatever keys the loss
returns, reduced over the step's micro-batches and processes by the loss's declared rules
(``recipe.declaration.reduce_metrics``), plus the plan's step-wide values, appended to TRL's ``_metrics`` once per
optimizer step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import trl
from trl.models.utils import disable_gradient_checkpointing

from recipe.hf_step import StepMetrics, StepWindow, check_sharding_backend
from recipe.optimizer_batch import MicroBatch, OptimizerBatchPlan, plan_optimizer_batch
from recipe.registry import get_policy_loss_spec, needs_step_log_probs
from recipe.trl.config import GRPOConfig
from recipe.trl.inputs import behaviour_log_probs, correction_weights_of, loss_mask
from recipe.trl.losses import check_vllm_logprobs_mode, declarations, loss_config, stalerl_loss_types, vllm_correction
from recipe.versions import check_framework_version

#: Inputs TRL passes to its log-prob forward besides ids and masks (vision models; refused for m2po/fipo at
#: construction, so these are None there); forwarded as TRL forwards them.
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _check_text_processing_class(loss_type: str, processing_class: Any) -> None:
    """Vision inputs are refused for m2po/fipo, by TRL's own rule for its vision-language path (a processor as
    ``processing_class``: TRL's ``_is_vlm``), before TRL builds anything: the adapter is not tested with them."""
    from trl.trainer.grpo_trainer import ProcessorMixin  # the very class TRL's `_is_vlm` test uses

    if isinstance(processing_class, ProcessorMixin):
        raise ValueError(f"recipe.trl: loss_type={loss_type!r} does not support vision inputs (processing_class is "
                         f"{type(processing_class).__name__}, a processor: TRL's vision-language path), which this "
                         "adapter is not tested with. Fix: a text model with its tokenizer as processing_class, or "
                         "one of TRL's own loss types")


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer; ``args.loss_type`` ``"m2po"`` / ``"fipo"`` runs stalerl's loss, exact at the optimizer
    step. ``args`` must be :class:`recipe.trl.GRPOConfig` for those two (TRL's own config lacks their keys)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_framework_version("trl", where="recipe.trl")
        cfg = kwargs.get("args", args[2] if len(args) > 2 else None)
        ours = cfg is not None and cfg.loss_type in stalerl_loss_types()
        if ours and not isinstance(cfg, GRPOConfig):
            raise TypeError(f"loss_type={cfg.loss_type!r} needs recipe.trl.GRPOConfig (it carries the losses' keys: "
                            f"m2_threshold, the fipo_* keys, ...), got {type(cfg).__module__}.{type(cfg).__name__}; "
                            "build the config with `from recipe.trl import GRPOConfig`")
        self._stalerl_loss = declarations()[cfg.loss_type].name if ours else None  # its recipe.registry name
        if ours:
            _check_text_processing_class(cfg.loss_type, kwargs.get("processing_class",
                                                                   args[5] if len(args) > 5 else None))
        super().__init__(*args, **kwargs)
        self._stalerl_window = StepWindow("recipe.trl")  # the current optimizer step's micro-batches and plan
        self._stalerl_metrics = StepMetrics()
        if self._uses_stalerl_loss:
            self._stalerl_check_backend()
            self._stalerl_check_model_inputs()
        if self._uses_stalerl_loss and self.use_vllm and self.vllm_mode == "server":
            self._stalerl_check_vllm_server()

    def _stalerl_check_backend(self) -> None:
        """DeepSpeed / FSDP (from accelerate's configuration, so only known once HF built the accelerator) are
        refused for m2po/fipo: the exact step is tested with plain DDP only."""
        check_sharding_backend("recipe.trl", f"loss_type={self.loss_type!r}",
                               deepspeed=bool(self.is_deepspeed_enabled),
                               fsdp=bool(self.is_fsdp_enabled))

    def _stalerl_check_model_inputs(self) -> None:
        """A MoE router auxiliary loss is refused for m2po/fipo, on TRL's own flag for it: the load-balancing loss is
        a function of each micro-batch's forward (its tokens' routing), not a sum over tokens, so a step's loss would
        depend on the split."""
        name = f"loss_type={self.loss_type!r}"
        if self.aux_loss_enabled:
            model = type(self.accelerator.unwrap_model(self.model)).__name__
            raise ValueError(f"recipe.trl: {name} does not support the MoE router auxiliary loss of {model} "
                             f"(router_aux_loss_coef={self.router_aux_loss_coef}): it is computed per micro-batch "
                             "forward, so the optimizer step's loss would depend on how the step is split. Fix: "
                             "GRPOConfig(router_aux_loss_coef=0.0)")

    def _stalerl_check_vllm_server(self) -> None:
        """TRL checks the server's ``--logprobs-mode`` only with its IS correction on; without it the sampler's
        log-probs are these losses' behaviour policy, so it is checked here too, on every process."""
        info: list[Any] = [None]
        if self.accelerator.is_main_process:
            server = self.vllm_generation.vllm_client.get_server_info()
            info[0] = (server.get("model_config") or {}).get("logprobs_mode")
        if self.accelerator.num_processes > 1:
            torch.distributed.broadcast_object_list(info, src=0)
        check_vllm_logprobs_mode(info[0], self.loss_type)

    @property
    def _stalerl_window_start(self) -> int:
        """``self._step`` at the current optimizer step's first micro-batch (read by the tests)."""
        return self._stalerl_window.start

    # ------------------------------------------------------------------------------------------------ the loss

    @property
    def _uses_stalerl_loss(self) -> bool:
        return self._stalerl_loss is not None

    def _log_probs(self, model: Any, inputs: dict[str, Any], *, compute_entropy: bool
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        extra = {key: inputs.get(key) for key in _FORWARD_KEYS}
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=compute_entropy,
            compute_aux_loss=False, **extra)  # a MoE auxiliary loss is refused at construction

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if not self._uses_stalerl_loss:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        per_token_logps, entropies, _ = self._log_probs(model, inputs, compute_entropy=True)
        mask = loss_mask(inputs)
        correction = vllm_correction(self.args)  # TRL's vLLM IS correction, as recipe.rollout_correction
        behaviour = behaviour_log_probs(inputs, per_token_logps, corrected=correction is not None)
        old = per_token_logps.detach() if behaviour is None else behaviour
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        advantages = advantages.expand_as(per_token_logps)

        plan, index = self._plan_for(inputs, per_token_logps, mode)
        config = plan.config_for(loss_config(self.args))
        extras = dict(plan.extras[index])
        if correction is not None:
            extras["rollout_is_weights"] = correction_weights_of(inputs, mask, correction)
        loss, metrics = self._policy_loss(old_log_prob=old, log_prob=per_token_logps, advantages=advantages,
                                          response_mask=mask, config=config, extras=extras)
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(per_token_logps - old)
            # the same denominator as the policy term, so the KL term is exact at the step too
            kl_sum = torch.where(mask.bool(), per_token_kl, torch.zeros_like(per_token_kl)).sum()
            loss = loss + self.beta * kl_sum / max(plan.num_tokens, 1) * plan.dp_size
            self._metrics[mode]["kl"].append(self._global_masked_mean(per_token_kl, mask))
        step_size = self._stalerl_window.size if mode == "train" else 1
        self._log_loss_metrics(mode, metrics, plan, index, entropies, mask, step_size)
        return loss

    def _policy_loss(self, *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, config: dict[str, Any], extras: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, dict[str, float]]:
        """The registry's loss on one micro-batch (one place, so a test can capture exactly what it received)."""
        return get_policy_loss_spec(self._stalerl_loss).fn(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
            loss_agg_mode="token-mean", config=config, **extras)

    # ------------------------------------------------------------------------------------- the optimizer step

    def _plan_for(self, inputs: dict[str, Any], per_token_logps: torch.Tensor, mode: str
                  ) -> tuple[OptimizerBatchPlan, int]:
        """(the plan of the optimizer step this micro-batch belongs to, its index in the step)."""
        if mode != "train":  # evaluation: one batch, no accumulation
            return self._plan([inputs], per_token_logps), 0
        return self._stalerl_window.enter(
            self._step, inputs, buffer=self._buffered_inputs, accumulation=self.current_gradient_accumulation_steps,
            steps_per_generation=self.args.steps_per_generation, num_iterations=self.num_iterations,
            make_plan=lambda batches: self._plan(batches, per_token_logps))

    def _extra_log_probs(self, batch: dict[str, Any]) -> torch.Tensor:
        """A later micro-batch's current log-probs, computed the way TRL computes its old log-probs: no grad, the
        model in the mode the trainer left it, gradient checkpointing off for the call (TRL's context manager)."""
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            return self._log_probs(self.model, batch, compute_entropy=False)[0]

    def _plan(self, batches: list[dict[str, Any]], first_logps: torch.Tensor) -> OptimizerBatchPlan:
        """Select and count over ``batches``; the first one's current log-probs are ``first_logps``."""
        # M2PO's batch selection and FIPO's row drops both decide from the step's current log-probs
        needs_selection = needs_step_log_probs(self._stalerl_loss)
        corrected = vllm_correction(self.args) is not None
        micro = []
        for j, batch in enumerate(batches):
            mask = loss_mask(batch)
            off_policy = "sampling_per_token_logps" in batch or "old_per_token_logps" in batch
            if not needs_selection or not off_policy:
                # no selection, or on-policy (log-ratio 0, Algorithm 1 keeps all): the count needs only the mask
                current = behaviour = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            else:
                if j == 0:
                    current = first_logps.detach()
                else:  # the step's weights are those of its first micro-batch
                    current = self._extra_log_probs(batch)
                behaviour = behaviour_log_probs(batch, current, corrected=corrected)
            adv = batch["advantages"]
            adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(mask.shape)
            micro.append(MicroBatch(behaviour.detach().float(), current.float(), adv.float(), mask))
        group = torch.distributed.group.WORLD if self.accelerator.num_processes > 1 else None
        return plan_optimizer_batch(self._stalerl_loss, micro, loss_config(self.args), group=group)

    # --------------------------------------------------------------------------------------------- metrics

    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        valid = mask.bool()
        local = torch.stack([torch.where(valid, values.detach().float(), torch.zeros((), device=values.device)).sum(),
                             valid.sum().float()])
        total = self.accelerator.reduce(local, reduction="sum")
        return (total[0] / total[1].clamp(min=1.0)).item()

    def _log_loss_metrics(self, mode: str, metrics: dict[str, float], plan: OptimizerBatchPlan, index: int,
                          entropies: Optional[torch.Tensor], mask: torch.Tensor, step_size: int) -> None:
        """The loss's metrics of the whole optimizer step (all micro-batches, all processes), appended once, at the
        step's last micro-batch (recipe.hf_step.StepMetrics: the declared rules, then the plan's step-wide values;
        TRL's ``log()`` then averages over its logging interval)."""
        acc = self._stalerl_metrics
        if index == 0:
            acc.add_plan(plan)
        acc.add(mask, metrics)
        if index == step_size - 1:
            group = torch.distributed.group.WORLD if self.accelerator.num_processes > 1 else None
            rules = get_policy_loss_spec(self._stalerl_loss).declaration.metrics
            for key, value in acc.reduce(rules, group).items():
                self._metrics[mode][key].append(float(value))
        if entropies is not None:
            store = self._metrics[mode]
            store["entropy"].append(self._global_masked_mean(entropies, mask))
