"""The optimizer step of a Hugging Face ``Trainer``-based GRPO trainer (TRL, ms-swift), seen from its loss calls.

Both TRL's and ms-swift's GRPO trainers generate once per ``steps_per_generation x num_iterations`` micro-steps,
keep that generation batch split into ``steps_per_generation`` micro-batches in ``trainer._buffered_inputs``, and
train micro-step ``k`` on ``_buffered_inputs[k % steps_per_generation]``. HF's Trainer then calls the loss once per
micro-batch and steps the optimizer every ``gradient_accumulation_steps`` of them. With ``steps_per_generation`` a
multiple of the accumulation steps, an optimizer step lies inside one generation batch, so at its first micro-batch
all of its micro-batches are in that buffer. This module holds the pieces both adapters share:

- :class:`StepWindow`: finds the step's micro-batches in the buffer at its first micro-batch, builds the step's plan
  once (the caller's ``make_plan``: M2PO's selection and the token count over the whole step and every rank), and
  checks at every later micro-batch that it is the one planned (a framework whose buffering changed fails loudly).
- :class:`StepMetrics`: every loss's metrics over all micro-batches and ranks of an optimizer step, logged once per
  step, reduced by :func:`recipe.declaration.reduce_metrics` with the loss's declared rules, plus the plan's
  step-wide values.
- :func:`check_sharding_backend`: the one refusal of DeepSpeed / FSDP (untested with the exact step).

Torch only; the frameworks are not imported (the adapters pass their trainer's attributes in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch


def step_micro_batches(buffer: Sequence[Any], *, micro_step: int, accumulation: int, steps_per_generation: int,
                       num_iterations: int, where: str) -> list[Any]:
    """The buffered entries of the optimizer step whose first micro-step is ``micro_step``.

    Raises one line when the step would span a new generation (its later micro-batches are not generated yet).
    """
    generate_every = int(steps_per_generation) * int(num_iterations)
    if any((micro_step + j) % generate_every == 0 for j in range(1, accumulation)):
        raise RuntimeError(f"{where}: the optimizer step starting at micro-step {micro_step} spans a new generation "
                           f"batch (steps_per_generation={steps_per_generation}, num_iterations={num_iterations}, "
                           f"{accumulation} accumulation steps), so its micro-batches are not known at its first one. "
                           "Fix: set steps_per_generation to a multiple of gradient_accumulation_steps")
    if len(buffer) < steps_per_generation:
        raise RuntimeError(f"{where}: the generation buffer holds {len(buffer)} micro-batches, expected "
                           f"steps_per_generation={steps_per_generation}; the framework's buffering changed")
    return [buffer[(micro_step + j) % steps_per_generation] for j in range(accumulation)]


@dataclass
class StepWindow:
    """The micro-batches and the plan of the optimizer step being trained (one per trainer)."""

    #: names the adapter in error messages (``recipe.trl``)
    where: str
    start: int = -1  # micro-step of the step's first micro-batch
    batches: list[Any] = field(default_factory=list)
    plan: Any = None

    def enter(self, micro_step: int, batch: Any, *, buffer: Sequence[Any], accumulation: int,
              steps_per_generation: int, num_iterations: int, make_plan: Callable[[list[Any]], Any],
              pick: Callable[[Any], Any] = lambda entry: entry) -> tuple[Any, int]:
        """(the step's plan, this micro-batch's index in the step). At a step's first micro-batch, reads the step
        from ``buffer`` (``pick`` maps a buffer entry to the object the loss receives) and calls ``make_plan`` on it.
        """
        index = micro_step - self.start
        if self.plan is None or not 0 <= index < len(self.batches):
            entries = step_micro_batches(buffer, micro_step=micro_step, accumulation=accumulation,
                                         steps_per_generation=steps_per_generation, num_iterations=num_iterations,
                                         where=self.where)
            batches = [pick(entry) for entry in entries]
            if batches[0] is not batch:
                raise RuntimeError(f"{self.where}: the micro-batch being trained at micro-step {micro_step} is not "
                                   f"_buffered_inputs[{micro_step % steps_per_generation}]; the exact loss relies on "
                                   "the framework's generation buffer, whose indexing changed")
            self.start, index, self.batches = micro_step, 0, batches
            self.plan = None
            self.plan = make_plan(batches)
        elif self.batches[index] is not batch:
            raise RuntimeError(f"{self.where}: micro-batch {index} of the optimizer step is not the one planned at the "
                               "step's first micro-batch; the exact loss relies on the framework's generation buffer")
        return self.plan, index

    @property
    def size(self) -> int:
        return len(self.batches)


def check_sharding_backend(where: str, loss: str, *, deepspeed: bool, fsdp: bool) -> None:
    """Refuse DeepSpeed and FSDP (set up through ``accelerate``) for this project's losses, with one line.

    The exact step rests on how HF's Trainer scales and accumulates the loss and on the extra no-grad forwards of
    the step's later micro-batches; under DeepSpeed (its own gradient accumulation and loss scaling, ZeRO-3's
    parameter gathering) and FSDP (sharded parameters) none of that is tested, so it is refused rather than run
    possibly inexact. The adapters call it once their trainer has built its accelerator, before the first update.
    """
    backend = "DeepSpeed" if deepspeed else "FSDP" if fsdp else None
    if backend is not None:
        raise ValueError(f"{where}: {loss} under {backend} is not supported: the exact optimizer step (one "
                         "whole-step plan, the step's token count, HF's loss scaling) is tested with plain "
                         f"data-parallel processes (DDP) only, not under {backend}'s own sharding and gradient "
                         f"accumulation. Fix: drop --{backend.lower()} and accelerate's {backend} configuration (plain "
                         "multi-process DDP: torchrun, or accelerate's multi-GPU mode), or use the framework's own "
                         "loss types")


# ------------------------------------------------------------------------------------------------ metrics

@dataclass
class StepMetrics:
    """One optimizer step's loss metrics, logged once per step: whatever keys the loss returns on each micro-batch,
    reduced over the step's micro-batches and every rank by :func:`recipe.declaration.reduce_metrics` with the loss's
    declared rules (the one reducer), plus the step-wide values of the step's plan (a batch selector's diagnostics,
    a row selector's counts), which are already over the whole step and every rank.

    ``add(response_mask, metrics)`` per micro-batch (its ``valid_tokens`` and ``rows`` are the reducer's weights);
    ``add_plan(plan)`` once per step; ``add_constant`` a value the same for the whole step (a flag).
    :meth:`reduce` gathers the parts over ``group`` (every rank must call it at the same micro-batch).
    """

    parts: list[tuple[dict[str, float], dict[str, float]]] = field(default_factory=list)
    step: dict[str, float] = field(default_factory=dict)

    def add(self, response_mask: torch.Tensor, metrics: dict[str, Any]) -> None:
        mask = response_mask.bool()
        rows = float(mask.shape[0]) if mask.dim() > 1 else 1.0
        self.parts.append(({"valid_tokens": float(mask.sum()), "rows": rows},
                           {key: float(value) for key, value in metrics.items()}))

    def add_plan(self, plan: Any) -> None:
        self.step.update(plan_metrics(plan))

    def add_constant(self, name: str, value: float) -> None:
        self.step.setdefault(name, float(value))

    def reduce(self, rules: Any, group: Optional[Any] = None) -> dict[str, float]:
        """The step's metrics over all ranks of ``group`` (None: this process only). Clears the accumulator."""
        from recipe.declaration import reduce_metrics

        parts = self.parts
        if group is not None:
            gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(gathered, parts, group=group)
            parts = [part for rank_parts in gathered for part in rank_parts]
        out = reduce_metrics(parts, rules)
        out.update(self.step)
        self.parts, self.step = [], {}
        return out


def plan_metrics(plan: Any) -> dict[str, float]:
    """The step-wide values of an :class:`recipe.optimizer_batch.OptimizerBatchPlan` (already over every micro-batch
    and rank): a batch selector's diagnostics (M2PO's ``m2po/*``) and a row selector's counts (FIPO's
    ``fipo/sequence_drop_ratio``, ``num_valid_tokens``, ``num_kept_tokens``, ``num_dropped_rows``, the latter also
    as ``num_dropped_sequences``, the adapters' name for it)."""
    out: dict[str, float] = {}
    if getattr(plan, "selection", None) is not None:
        out.update((key, float(value)) for key, value in plan.selection.metrics().items())
    drops = getattr(plan, "row_drops", None)
    if drops is not None:
        out.update(drops.metrics())
        out[f"{drops.loss_name}/num_dropped_sequences"] = float(drops.num_dropped_rows)
    return out


def step_metric_keys(loss_name: str) -> tuple[str, ...]:
    """The keys logged per optimizer step for loss ``loss_name``: its declared metrics, and a row selector's counts."""
    from recipe.registry import get_declaration

    declaration = get_declaration(loss_name)
    keys = tuple(declaration.metrics)
    if declaration.step == "row_selector":
        keys += tuple(f"{loss_name}/{k}" for k in ("sequence_drop_ratio", "num_valid_tokens", "num_kept_tokens",
                                                    "num_dropped_rows", "num_dropped_sequences")
                      if f"{loss_name}/{k}" not in keys)
    return keys


def __getattr__(name: str) -> Any:
    if name == "FIPO_STEP_METRICS":  # the fipo/* names logged per step (documented per framework; tests)
        return step_metric_keys("fipo")
    raise AttributeError(f"module 'recipe.hf_step' has no attribute {name!r}")


__all__ = ["StepMetrics", "StepWindow", "check_sharding_backend", "plan_metrics", "step_metric_keys",
           "step_micro_batches"]
