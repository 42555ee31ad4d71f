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
- :class:`StepMetrics`: the one metrics policy of every adapter. ``m2po/*`` and ``fipo/*`` values are reduced over
  all micro-batches and ranks of an optimizer step and logged once per step: counts are summed, fractions are the
  summed numerator over the summed denominator, maxima the max, minima the min.
- :func:`check_sharding_backend`: the one refusal of DeepSpeed / FSDP (untested with the exact step).

Torch only; the frameworks are not imported (the adapters pass their trainer's attributes in).
"""

from __future__ import annotations

import math
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

SUM, RATIO, MAX, MIN = "sum", "ratio", "max", "min"


@dataclass
class StepMetrics:
    """Accumulates one optimizer step's loss metrics over its micro-batches; reduced over ranks at its end.

    ``add_sum(name, value)``: a count (summed). ``add_ratio(name, numerator, denominator)``: a fraction (summed
    numerator / summed denominator). ``add_max`` / ``add_min``: extrema. ``add_constant``: a value that is the same
    for the whole step (e.g. a step-wide selection's diagnostics, or a flag): taken from the first micro-batch.
    :meth:`reduce` runs the collectives (every rank must call it at the same micro-batch) and returns the dict to log.
    """

    sums: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)
    constants: dict[str, float] = field(default_factory=dict)

    def add_sum(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def add_ratio(self, name: str, numerator: float, denominator: float) -> None:
        acc = self.ratios.setdefault(name, [0.0, 0.0])
        acc[0] += float(numerator)
        acc[1] += float(denominator)

    def add_max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), float(value))

    def add_min(self, name: str, value: float) -> None:
        self.minima[name] = min(self.minima.get(name, math.inf), float(value))

    def add_constant(self, name: str, value: float) -> None:
        self.constants.setdefault(name, float(value))

    def reduce(self, group: Optional[Any] = None, device: Any = "cpu") -> dict[str, float]:
        """The step's metrics, over all ranks of ``group`` (None: this process only). Clears the accumulator."""
        sum_keys, ratio_keys = sorted(self.sums), sorted(self.ratios)
        max_keys, min_keys = sorted(self.maxima), sorted(self.minima)
        summed = [self.sums[k] for k in sum_keys] + [v for k in ratio_keys for v in self.ratios[k]]
        extrema = [self.maxima[k] for k in max_keys] + [-self.minima[k] for k in min_keys]
        if group is not None:
            dist = torch.distributed
            if summed:
                t = torch.tensor(summed, dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
                summed = t.tolist()
            if extrema:
                t = torch.tensor(extrema, dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                extrema = t.tolist()
        out: dict[str, float] = dict(self.constants)
        out.update(zip(sum_keys, summed[:len(sum_keys)]))
        pairs = summed[len(sum_keys):]
        for i, key in enumerate(ratio_keys):
            num, den = pairs[2 * i], pairs[2 * i + 1]
            out[key] = num / den if den > 0 else 0.0
        out.update(zip(max_keys, extrema[:len(max_keys)]))
        out.update((k, -v) for k, v in zip(min_keys, extrema[len(max_keys):]))
        self.sums, self.ratios, self.maxima, self.minima, self.constants = {}, {}, {}, {}, {}
        return out


@torch.no_grad()
def add_fipo_micro_batch(metrics: StepMetrics, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                         advantages: torch.Tensor, response_mask: torch.Tensor, config: Any) -> None:
    """One FIPO micro-batch's share of the step's ``fipo/*`` metrics, as numerators and denominators.

    The per-token quantities are recomputed without grad by the loss's own functions (``fipo_weights``, the PPO
    surrogate), so the step's figures are exact sums over its tokens, not averages of per-micro-batch fractions:
    ``fipo/influence_weights_mean_raw`` and the influence-weight clip ratios over valid tokens,
    ``fipo/sequence_drop_ratio`` over rows, ``fipo/clip_fraction`` (PPO clip active) and
    ``fipo/dual_clip_fraction`` (dual clip at c active) over the tokens that enter the loss (valid, not dropped),
    and the counts ``fipo/num_valid_tokens``, ``fipo/num_dropped_sequences``.
    """
    from recipe.common import masked_log_ratio
    from recipe.fipo.algorithm import METRIC_DENOMINATORS, fipo_metric_parts, fipo_params_from_config

    params = fipo_params_from_config(config)
    valid = response_mask.bool()
    d = masked_log_ratio(old_log_prob.detach().float(), log_prob.detach().float(), valid)
    parts = fipo_metric_parts(d, advantages, valid, params)
    for key, numerator in parts.numerators.items():
        metrics.add_ratio(key, numerator, parts.denominators[METRIC_DENOMINATORS[key]])
    metrics.add_sum("fipo/num_valid_tokens", parts.denominators["valid_tokens"])
    metrics.add_sum("fipo/num_dropped_sequences", parts.numerators["fipo/sequence_drop_ratio"])


#: The ``fipo/*`` names :func:`add_fipo_micro_batch` logs (documented per framework).
FIPO_STEP_METRICS = ("fipo/influence_weights_mean_raw", "fipo/influence_weight_clip_ratio_upper",
                     "fipo/influence_weight_clip_ratio_lower", "fipo/sequence_drop_ratio", "fipo/clip_fraction",
                     "fipo/dual_clip_fraction", "fipo/num_valid_tokens", "fipo/num_dropped_sequences")


def add_plan_selection(metrics: StepMetrics, plan: Any) -> None:
    """The step-wide selection's diagnostics (M2PO: ``m2po/*``, already over every micro-batch and rank)."""
    if getattr(plan, "selection", None) is not None:
        for key, value in plan.selection.metrics().items():
            metrics.add_constant(key, float(value))


__all__ = ["FIPO_STEP_METRICS", "StepMetrics", "StepWindow", "add_fipo_micro_batch", "add_plan_selection",
           "check_sharding_backend", "step_micro_batches"]
