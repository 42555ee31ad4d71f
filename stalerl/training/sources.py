"""Rollout sources: where the training loop (:class:`stalerl.training.trainer.Trainer`) gets the batch of each step.

The loop is the same for every run: ``batch = source.next_batch(version)``, advantages, the actor's update, then
``source.after_update(version + 1)``; logging, evaluation and checkpoints go through the source's hooks too. Two
sources, one staleness mechanism each (both in :mod:`stalerl.training.staleness`):

- :class:`FixedStalenessSource` (synchronous, the default): generates in this process with the trainer's own model,
  delayed by ``rollout.fixed_staleness`` steps (:class:`~stalerl.training.staleness.StaleFIFO`);
- :class:`stalerl.training.async_source.AdmissionSource` (asynchronous dX+dY): rollout worker processes generate
  while training goes on, admitted by ``rollout.max_head_offpolicyness`` / ``max_concurrent_rollouts``
  (:class:`~stalerl.training.staleness.StalenessManager`).

The launcher picks one (:func:`stalerl.launch.launcher.build_trainer`). Each source is built by its ``for_trainer``
from the parts of the trainer it uses, named one by one (its ``__init__`` takes them explicitly).
"""

from __future__ import annotations

import copy
import random
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, Optional

import torch

from stalerl.core import interrupt
from stalerl.rollout.batch import RolloutBatch
from stalerl.rollout.engine import evaluate_engine, generation_seed
from stalerl.training.mismatch import engine_mismatch
from stalerl.training.staleness import StaleFIFO

EVAL_SUBSET_SEED = 0  # the same subset in every run (any seed, any loss) on the same evaluation data


def eval_subset(examples: list, n: Optional[int]) -> Optional[list]:
    """evaluator.n_prompts_during_training: a fixed subset of ``n`` of ``examples`` (seeded by EVAL_SUBSET_SEED, not
    the run's seed, so runs compare on the same problems; in their original order), or None when ``n`` is null or
    covers them all. Drawn with its own generator: no global random state moves."""
    if n is None or n >= len(examples):
        return None
    keep = sorted(random.Random(EVAL_SUBSET_SEED).sample(range(len(examples)), n))
    return [examples[i] for i in keep]


@dataclass
class EvalPlan:
    """Which prompts the evaluation of a weight version uses, and the names its accuracy is logged under."""
    examples: list  # valid_dataset, after filtering, cut to evaluator.n_prompts
    subset: Optional[list]  # evaluator.n_prompts_during_training's subset (None: every evaluation is full)
    total_steps: int

    def is_full(self, version: int) -> bool:
        """Whether the evaluation of weights ``version`` uses every evaluation prompt: always without
        evaluator.n_prompts_during_training; with it, at step 0 (evaluator.at_start) and at the last step only."""
        return self.subset is None or version <= 0 or version >= self.total_steps

    def examples_for(self, version: int) -> list:
        return self.examples if self.is_full(version) else self.subset

    def metrics(self, accuracy: float, version: int) -> dict[str, float]:
        """The metric names of an evaluation: eval/accuracy for a full one (the only name the run summary and the
        study report read), eval/accuracy_subset for a subset one; eval/n_prompts beside either when a subset is
        configured (without one the row is exactly what it always was)."""
        if self.subset is None:
            return {"eval/accuracy": accuracy}
        full = self.is_full(version)
        return {"eval/accuracy" if full else "eval/accuracy_subset": accuracy,
                "eval/n_prompts": float(len(self.examples_for(version)))}


class MismatchProbe:
    """stats_logger.mismatch_freq_steps: the train/infer mismatch (stalerl.training.mismatch) of fresh samples, at
    most once per such step. Takes ``stats_logger`` and ``actor.behavior_logp``."""

    def __init__(self, stats_logger: Any, behavior_logp: str):
        self.freq = stats_logger.mismatch_freq_steps
        self.max_rows = stats_logger.mismatch_max_rows
        self.behavior_logp = behavior_logp
        self.last_step = -1  # the step whose fresh data was last probed
        self.seconds = 0.0  # this step's probe time (timing/mismatch_probe_s)

    def step_due(self, step: int) -> bool:
        """Once per stats_logger.mismatch_freq_steps steps, on the first batch generated at that step."""
        return bool(self.freq) and step % self.freq == 0 and self.last_step != step

    def due(self, step: int) -> bool:
        """The probe (an extra no-grad pass): due at such a step when the behaviour log-probs are the engine's
        (behavior_logp=rollout; with recompute the recompute pass gives the mismatch)."""
        return self.behavior_logp == "rollout" and self.step_due(step)

    def probe(self, actor: Any, batch: RolloutBatch) -> dict[str, float]:
        """The mismatch/* metrics of ``batch`` (generated by ``actor``'s current weights). A no-grad pass that draws
        no random number; its time goes to timing/mismatch_probe_s, not to the log-prob split."""
        start, logp_seconds = time.perf_counter(), actor.logp_seconds
        if self.max_rows is not None and batch.num_rows > self.max_rows:
            batch = batch.select(list(range(self.max_rows)))
        trainer_logp = actor.compute_logp(batch)
        actor.logp_seconds = logp_seconds
        out = engine_mismatch(trainer_logp, batch.behavior_logp, batch.response_mask)
        self.seconds += time.perf_counter() - start
        return out


@dataclass
class StepTimes:
    """What the loop measured during one step, for the source's row (:meth:`RolloutSource.step_row`)."""
    start: float  # time.perf_counter() at the start of the step
    fetch_s: float  # in next_batch
    logp_fetch_s: float  # no-grad log-prob passes in next_batch (actor.behavior_logp=recompute)
    train_s: float  # the actor's update
    logp_train_s: float  # a batch selector's (M2PO's) no-grad pass during the update
    optimizer_s: float  # gradient clipping and the optimizer step


class RolloutSource(ABC):
    """The interface the training loop consumes. Default hooks are those of a source that generates in the
    trainer's process; the asynchronous source overrides the worker-side ones."""

    #: whether generation runs in the trainer's process (its engine: vLLM or HF); otherwise the trainer keeps an HF
    #: engine for the warm start's accuracy checks only
    in_process: ClassVar[bool] = True
    #: the last checkpoint held metric rows back (only a source that evaluates elsewhere holds any)
    saved_with_held_rows: bool = False

    @classmethod
    @abstractmethod
    def for_trainer(cls, trainer: Any) -> "RolloutSource":
        raise NotImplementedError

    # lifecycle
    def start(self) -> None:
        """Before the recovery and the warm start (worker processes start here)."""

    def on_training_start(self, version: int) -> None:
        """After the warm start or restore, before the first step: the weights of ``version`` are the ones to
        generate with."""

    def failure_cause(self, exc: BaseException) -> Optional[BaseException]:
        """The error to report instead of ``exc`` (e.g. the worker failure behind a collective's error), or None."""
        return None

    def shutdown(self) -> None:
        """At the end of ``train``, however it ended."""

    # one step
    @abstractmethod
    def next_batch(self, version: int) -> RolloutBatch:
        raise NotImplementedError

    def after_update(self, version: int) -> None:
        """The update is done: ``version`` is the new weight version (publish it)."""

    @abstractmethod
    def step_row(self, metrics: dict[str, Any], batch: RolloutBatch, stale: dict[str, Any],
                 batch_metrics: dict[str, float], times: StepTimes, version: int) -> dict[str, Any]:
        """The step's metrics row, completing the actor's ``metrics`` (each source writes the row it always has)."""
        raise NotImplementedError

    # the update (a source whose workers include extra data-parallel train ranks runs it on them too)
    def update(self, actor: Any, batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
        return actor.update(batch, advantages)

    def can_skip_whole_step(self) -> bool:
        return True

    # evaluation and the metrics log
    @abstractmethod
    def evaluate(self, version: int) -> dict[str, float]:
        raise NotImplementedError

    def wrap_logger(self, logger: Any) -> Any:
        """The metrics logger the loop writes through. Here: the logger itself."""
        return logger

    def log_finished_evaluations(self, logger: Any, *, wait: bool) -> None:
        """Write what evaluations that finished since the last call complete; ``wait``: the end of training, every
        requested evaluation is waited for. Nothing to do for a source that evaluates in place."""

    # checkpoint
    def checkpoint_state(self, loop_state: Callable[[Optional[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint's state: the loop's (``loop_state(actor_state)``; ``actor_state`` None: the actor's own
        state_dict) with the source's merged at the top level."""
        state = loop_state(None)
        state.update(self.state_dict())
        return state

    def snapshot_state(self, loop_state: Callable[[Optional[dict[str, Any]]], dict[str, Any]],
                       actor_placeholder: Any) -> dict[str, Any]:
        """What :meth:`checkpoint_state` would save now, as an independent copy, with ``actor_placeholder`` for the
        actor's state (stalerl.training.last_step copies that only when it is about to change). Taken at every step
        boundary, so it waits for nothing."""
        state = loop_state(actor_placeholder)
        state.update(self.state_dict())
        return copied_except_actor(state, actor_placeholder)

    def abandon_logger(self, logger: Any) -> None:
        """The step in progress is abandoned (the run stops; the checkpoint of the last completed step is saved):
        close the metrics log as it stands (a resume drops rows beyond its checkpoint)."""
        logger.close()

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        """From the checkpoint's top level; ``version``: its step."""
        raise NotImplementedError


def copied_except_actor(state: dict[str, Any], actor_placeholder: Any) -> dict[str, Any]:
    """A deep copy of ``state`` but its actor entry (the placeholder), so the step's later work changes nothing in
    it (the FIFO's batches, held metric rows, RNG arrays)."""
    rest = copy.deepcopy({k: v for k, v in state.items() if k != "actor"})
    return {**rest, "actor": actor_placeholder}


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory since the process started: the CUDA caching allocator's allocated/reserved bytes on a GPU, the
    process's peak RSS otherwise (GiB)."""
    if device.type == "cuda":
        return {"memory/gpu_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "memory/gpu_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    try:
        import resource
    except ImportError:  # not on Windows
        return {}
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # Linux: KiB


class FixedStalenessSource(RolloutSource):
    """Synchronous and fixed-staleness rollouts (rollout.max_head_offpolicyness = 0): generated in this process with
    the trainer's own model, so the engine always samples from the trainer's current weights, and consumed
    ``rollout.fixed_staleness`` steps later."""

    in_process = True

    def __init__(self, rollout: Any, *, engine: Any, dataset: Any, actor: Any, gconfig: Any, seed: int,
                 behavior_logp: str, probe: MismatchProbe, eval_plan: EvalPlan, eval_gconfig: Any,
                 eval_batch_size: int, device: torch.device):
        self.rollout = rollout
        self.engine, self.dataset, self.actor = engine, dataset, actor
        self.gconfig, self.seed, self.behavior_logp = gconfig, seed, behavior_logp
        self.probe, self.eval_plan = probe, eval_plan
        self.eval_gconfig, self.eval_batch_size = eval_gconfig, eval_batch_size
        self.device = device
        self.fifo = StaleFIFO(rollout.fixed_staleness)
        self.version = 0
        self.tasks_generated = 0  # prompt groups generated so far; seeds each generate call (see generation_seed)
        self._gen_rewards: list[torch.Tensor] = []  # rewards of the batches generated during the current step
        self._mismatch: dict[str, float] = {}  # this step's mismatch/* metrics
        self._gen_seconds, self._gen_tokens = 0.0, 0  # this step's generation time and tokens (next_batch resets)
        self._sync0: Optional[float] = None

    @classmethod
    def for_trainer(cls, trainer: Any) -> "FixedStalenessSource":
        cfg = trainer.cfg
        return cls(cfg.rollout, engine=trainer.engine, dataset=trainer.dataset, actor=trainer.actor,
                   gconfig=cfg.gconfig, seed=cfg.seed, behavior_logp=cfg.actor.behavior_logp, probe=trainer.probe,
                   eval_plan=trainer.eval_plan, eval_gconfig=cfg.eval_gconfig,
                   eval_batch_size=cfg.valid_dataset.batch_size, device=trainer.device)

    def _engine_kwargs(self, first_task_id: int, n_prompts: int, n_samples: int) -> dict:
        """vLLM: per-prompt seeds when rollout.vllm.seeded_requests asks for them, else nothing (vLLM's batched
        sampler). The HF engine is seeded through the global RNG by the caller."""
        if not hasattr(self.engine, "source_model"):
            return {}
        from stalerl.rollout.vllm_engine import generate_kwargs

        # it reads rollout.vllm.seeded_requests and the run's seed
        return generate_kwargs(SimpleNamespace(rollout=self.rollout, seed=self.seed),
                               range(first_task_id, first_task_id + n_prompts), n_samples)

    def generate_batch(self) -> RolloutBatch:
        g = self.gconfig
        examples = self.dataset.next_batch()
        self.engine.set_version(self.version)
        # Seeded by the first task id, as the asynchronous workers do: with max_head_offpolicyness=0 both loops
        # sample exactly the same tokens.
        torch.manual_seed(generation_seed(self.seed, self.tasks_generated))
        seeds = self._engine_kwargs(self.tasks_generated, len(examples), g.n_samples)
        self.tasks_generated += len(examples)
        batch = self.engine.generate([e.question for e in examples], [e.final for e in examples],
                                     n_samples=g.n_samples, max_new_tokens=g.max_new_tokens,
                                     temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, **seeds)
        interrupt.pause_for_test("generation", self.version + 1)  # data, RNG and task counter have moved
        if self.behavior_logp == "recompute":
            # The authors' choice: behaviour log-probs from the training engine at the generating weights (which
            # are the current weights at generation time in this loop), so train/infer mismatch stays out of M2.
            recomputed = self.actor.compute_logp(batch)
            if self.probe.step_due(self.version):
                # the recompute is the trainer's pass at the generating weights: the mismatch comes for free
                self.probe.last_step = self.version
                self._mismatch = engine_mismatch(recomputed, batch.behavior_logp, batch.response_mask)
            batch.set_trainer_logp(recomputed)  # the engine's log-probs stay in batch.engine_logp
        elif self.probe.due(self.version):
            self.probe.last_step = self.version
            self._mismatch = self.probe.probe(self.actor, batch)  # fresh: generated by the weights just trained
        self._gen_rewards.append(batch.rewards)
        self._gen_seconds += self.engine.last_generate_seconds
        self._gen_tokens += batch.num_response_tokens
        return batch

    def next_batch(self, version: int) -> RolloutBatch:
        self.version = version
        self._gen_seconds, self._gen_tokens = 0.0, 0
        self._gen_rewards = []  # reward/generated: this step's fresh batches (under a FIFO, not the consumed one)
        self._mismatch, self.probe.seconds = {}, 0.0
        self._sync0 = getattr(self.engine, "sync_seconds_total", None)  # vLLM: weight syncs happen in generation
        return self.fifo.next_batch(self.generate_batch)

    def after_update(self, version: int) -> None:
        self.version = version  # the engine is brought to it at its next generation (vLLM: re-synced then)

    def step_row(self, metrics, batch, stale, batch_metrics, times, version):
        t_gen = times.fetch_s - self.probe.seconds
        t_train, logp_gen, logp_train = times.train_s, times.logp_fetch_s, times.logp_train_s
        metrics.update(stale)
        metrics.update(batch_metrics)
        if self._gen_rewards:
            metrics["reward/generated"] = float(torch.cat(self._gen_rewards).float().mean())
        train_tokens = float(batch.attention_mask().sum())
        metrics.update({
            "timing/gen_s": t_gen, "timing/train_s": t_train, "timing/step_s": time.perf_counter() - times.start,
            # the same step cut into three disjoint phases: sampling, no-grad log-prob passes, forward/backward+step
            "timing/split/generation_s": t_gen - logp_gen, "timing/split/logp_s": logp_gen + logp_train,
            "timing/split/training_s": t_train - logp_train,
            # training_s = forward_backward_s + optimizer_s (gradient clipping and the optimizer step)
            "timing/split/forward_backward_s": t_train - logp_train - times.optimizer_s,
            "timing/split/optimizer_s": times.optimizer_s,
            "throughput/gen_tokens_per_s": self._gen_tokens / self._gen_seconds if self._gen_seconds else 0.0,
            "throughput/train_tokens_per_s": train_tokens / t_train if t_train else 0.0,
            "version": float(version),
        })
        if self._sync0 is not None:
            metrics["timing/weight_sync_s"] = self.engine.sync_seconds_total - self._sync0  # part of generation_s
        if self._mismatch:
            metrics.update(self._mismatch)
            metrics["timing/mismatch_probe_s"] = self.probe.seconds
        metrics.update(peak_memory_metrics(self.device))
        return metrics

    @torch.no_grad()
    def evaluate(self, version: int) -> dict[str, float]:
        """Greedy (eval_gconfig) accuracy on valid_dataset with this process's engine at the current weights."""
        if hasattr(self.engine, "source_model"):  # vLLM keeps its own weights: bring them to this step's
            self.engine.set_version(version)
        examples = self.eval_plan.examples_for(version)
        out = evaluate_engine(self.engine, examples, self.eval_gconfig, self.eval_batch_size)
        return self.eval_plan.metrics(out["accuracy"], version)

    def state_dict(self) -> dict[str, Any]:
        return {"fifo": self.fifo.state_dict(), "tasks_generated": self.tasks_generated}

    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        self.fifo.load_state_dict(state["fifo"])
        self.tasks_generated = int(state["tasks_generated"])
        self.version = version
