"""The training loop, top to bottom: build everything from the config, warm start, then
batch from the rollout source -> reward/advantage -> registered loss update -> log / evaluate / checkpoint.

One loop for every run; where each step's batch comes from is its rollout source (:mod:`stalerl.training.sources`):
the synchronous fixed-staleness FIFO (the default) or the asynchronous admission source over rollout workers
(:mod:`stalerl.training.async_source`). The launcher picks one (``Trainer(cfg, source=...)``).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Any, Optional

import numpy as np
import torch

from stalerl.training.actor import Actor, correction_params
from stalerl.training.advantage import grpo_advantages, shaped_rewards, zero_advantage_rows
from stalerl.training.checkpoint import capture_rng_state, load_latest_checkpoint, restore_rng_state, save_checkpoint
from stalerl.config import ExperimentConfig, run_dir, save_resolved_config
from stalerl.config.placement import passive_wait_for_workers, placement_line
from stalerl.config.rules import resolve_compute_dtype, resolve_rollout_backend
from stalerl.core import interrupt
from stalerl.core.errors import NotAvailableError, UserError
from stalerl.data import PromptDataset, load_examples
from stalerl.data.fit import check_data_fits
from stalerl.results.metrics_log import MetricsLogger, Progress, format_summary, loss_fraction_keys
from stalerl.results.tracking import open_metrics_logger
from stalerl.core.model import PromptFormatter, load_policy_from_config, resolve_device
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.batch import RolloutBatch
from stalerl.rollout.engine import HFRolloutEngine
from stalerl.training.sources import (EvalPlan, FixedStalenessSource, MismatchProbe, RolloutSource, StepTimes,
                                      eval_subset)
from stalerl.training.staleness import staleness_stats
from stalerl.training import trial_dir
from stalerl.training.last_step import LIVE, LastStep
from stalerl.training.warm_start import warm_start

from stalerl.core.launch_env import LAUNCH_TIME_ENV  # noqa: E402,F401 - re-exported

#: A step whose value here is non-finite has diverged (the optimizer step that follows would poison the weights).
DIVERGENCE_KEYS = ("actor/loss", "actor/grad_norm")


class TrainingDiverged(UserError):
    """The loss, gradient norm or log-probs became non-finite. The run ends with ``status: diverged`` in its
    summary (with its curves up to that step), which the study report counts as a collapse, never as missing."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"training diverged at step {step}: {reason}; summary.json records status 'diverged' "
                         "(a collapse in the study report). To avoid it: a trust region (actor.loss=m2po or vanilla), "
                         "a lower actor.optimizer.lr, or actor.optimizer.gradient_clipping > 0")
        self.step = step


def divergence_reason(exc: BaseException) -> Optional[str]:
    """One line saying why the run diverged, when ``exc`` says it did, else None: the loss refused non-finite
    log-probs or advantages on valid tokens (``recipe.common.NonFiniteLogProbError``), in this process or in a train
    worker's (whose ``WorkerFailure`` carries the exception's type name: a train rank's divergence reaches rank 0 as
    a collective error first). Classified by the exception's type, never by its message."""
    from recipe.common import NonFiniteLogProbError
    from stalerl.training.workers.process import WorkerFailure

    if isinstance(exc, NonFiniteLogProbError):
        return str(exc).splitlines()[0][:300]
    kind = getattr(exc, "exc_type", None)  # the worker's exception class name (stalerl.training.workers.process)
    if isinstance(exc, WorkerFailure) and kind == NonFiniteLogProbError.__name__:
        first = str(exc.message).splitlines()[0] if exc.message else ""
        text = first.split(": ", 1)[1] if first.startswith(f"{kind}: ") else first
        return f"{exc.role}: {text}"[:300]
    return None


def nonfinite(metrics: dict[str, Any], keys=DIVERGENCE_KEYS) -> list[str]:
    """``key=value`` for each of ``keys`` that is present and not finite."""
    out = []
    for k in keys:
        v = metrics.get(k)
        if isinstance(v, float) and not np.isfinite(v):
            out.append(f"{k}={v}")
    return out
# the step's log line; the loss's own headline fraction (actor/<loss>/masked_fraction or clip_fraction, whichever loss
# runs: metrics_log.loss_fraction_keys) goes before the step time
SUMMARY_KEYS = ("reward", "eval/accuracy", "eval/accuracy_subset", "actor/loss", "actor/grad_norm", "staleness/avg")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def steps_per_epoch(train_dataset: Any, num_train_examples: int) -> int:
    per_epoch = num_train_examples // train_dataset.batch_size
    if not train_dataset.drop_last and num_train_examples % train_dataset.batch_size:
        per_epoch += 1
    return per_epoch


def total_steps(train_dataset: Any, num_train_examples: int, *, epochs: int, max_steps: Optional[int]) -> int:
    """``epochs``: total_train_epochs; ``max_steps``: total_train_steps (None: no cap)."""
    steps = steps_per_epoch(train_dataset, num_train_examples) * epochs
    if max_steps is not None:
        steps = min(steps, max_steps) if steps > 0 else max_steps
    return max(0, steps)


class Trainer:
    eval_subset: Optional[list] = None  # evaluator.n_prompts_during_training's subset (None: all evaluations full)

    def __init__(self, cfg: ExperimentConfig, *, source: type[RolloutSource] = FixedStalenessSource, log=print):
        """``source``: the rollout source class (built here, once the model and data exist); the synchronous
        fixed-staleness FIFO unless the launcher picks another."""
        self.launch_time = float(os.environ.get(LAUNCH_TIME_ENV, time.time()))
        self.excluded_s = 0.0  # warm start and evaluation: work, not start-up overhead
        self.cfg = cfg
        self.log = log
        # rollout.backend=auto:dX becomes hf:dX or vllm:dX here, with one line saying which and why, before the
        # config is saved: config.yaml, checkpoints, the summary and the workers all record the engine that ran.
        resolve_rollout_backend(cfg, log=self.log)
        resolve_compute_dtype(cfg, log=self.log)  # actor.dtype=auto: the same, for the hardware's bf16 units
        self.log(placement_line(cfg))  # processes x threads per role against this machine's CPUs
        wait_line = passive_wait_for_workers(cfg)  # before any worker process exists: they inherit it
        if wait_line:
            self.log(wait_line)
        self.engine_name = engine = cfg.rollout.backend.split(":", 1)[0]
        if engine not in ("hf", "vllm"):
            raise NotAvailableError(
                f"rollout.backend={cfg.rollout.backend!r}: the {engine} rollout engine is not available in this "
                "version; use rollout.backend=hf:dX (transformers generate) or vllm:dX")
        if engine == "vllm":
            from stalerl.rollout.vllm_engine import (INSTALL_HINT, VLLMNotInstalled, check_vllm_version,
                                                     installed_vllm_version, vllm_available)

            if not vllm_available():  # before any work: data, model, warm start
                raise VLLMNotInstalled(INSTALL_HINT)
            check_vllm_version(installed_vllm_version())
        torch.set_num_threads(cfg.torch_threads)
        seed_everything(cfg.seed)
        self.run_dir = run_dir(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved_config(cfg, self.run_dir / "config.yaml")

        # Data first: a wrong path fails before the model is built.
        self.train_examples = self._load_split(cfg.train_dataset, "train_dataset")
        self.valid_examples = self._load_split(cfg.valid_dataset, "valid_dataset")
        check_data_fits(cfg, self.train_examples, self.valid_examples)  # before the model: one line, exit 2

        self.device = resolve_device(cfg.actor.device)
        self.model, self.tokenizer = load_policy_from_config(cfg)
        self.formatter = PromptFormatter.from_config(self.tokenizer, cfg)
        self.train_examples = self._filter_by_prompt_tokens(self.train_examples, cfg.train_dataset, "train_dataset")
        self.valid_examples = self._filter_by_prompt_tokens(self.valid_examples, cfg.valid_dataset,
                                                            "valid_dataset")[:cfg.evaluator.n_prompts]
        self.eval_subset = eval_subset(self.valid_examples, cfg.evaluator.n_prompts_during_training)
        check_data_fits(cfg, self.train_examples, self.valid_examples, stage="after dropping prompts longer than "
                        "train_dataset.max_length / valid_dataset.max_length tokens", evaluation_size=False)
        self.dataset = PromptDataset(self.train_examples, batch_size=cfg.train_dataset.batch_size,
                                     shuffle=cfg.train_dataset.shuffle, drop_last=cfg.train_dataset.drop_last,
                                     seed=cfg.seed)
        self.total_steps = total_steps(cfg.train_dataset, len(self.train_examples), epochs=cfg.total_train_epochs,
                                       max_steps=cfg.total_train_steps)
        self.actor = Actor(self.model, cfg.actor, temperature=cfg.gconfig.temperature,
                           total_updates=self.total_steps * cfg.actor.ppo_n_minibatches,
                           loss_scale_factor=cfg.gconfig.max_new_tokens, correction=correction_params(cfg),
                           log=self.log)  # update progress lines (issue 43 item 7)
        if not self.actor.chunked_logprobs:  # once, at start (stalerl.core.chunked_logprob.chunked_logprob_check)
            self.log(f"stalerl: log-probs use the plain logits path, not the chunked head: "
                     f"{self.actor.chunked_logprobs_reason} (each update records actor/chunked_logprobs=0)")
        self.engine = self._build_engine(in_process=source.in_process)
        self.step = 0  # optimizer steps taken = the trainer's weight version
        self.on_disk_step: Optional[int] = None  # the step of the newest checkpoint this trial has on disk
        self.last_saved_at = time.monotonic()  # recover.freq_minutes counts from here (the last checkpoint)
        self.last_step = LastStep(copy_actor=cfg.recover.last_step_copy)  # saved if a stop cuts the next step
        self.warm_start_done = False
        self.eval_plan = EvalPlan(self.valid_examples, self.eval_subset, self.total_steps)
        self.probe = MismatchProbe(cfg.stats_logger, cfg.actor.behavior_logp)  # stats_logger.mismatch_freq_steps
        self.source = source.for_trainer(self)
        if os.environ.get(interrupt.PAUSE_ENV, "").startswith("update@"):  # a test lands a stop mid-update
            self.actor.optimizer.register_step_post_hook(
                lambda *_: interrupt.pause_for_test("update", self.step + 1))

    # ------------------------------------------------------------------ pieces
    def _build_engine(self, *, in_process: bool = True):
        """This process's engine. vLLM holds its own copy of the weights: it starts from the trainer's module at the
        first generation (after warm start or a resume) and is re-synced when the step moves on. A source that
        generates elsewhere (rollout workers) leaves an HF engine here, for the warm start's checks only."""
        if self.engine_name == "vllm" and in_process:
            from stalerl.rollout.vllm_engine import build_vllm_engine

            from stalerl.training.prompt_lengths import longest_prompt_tokens

            longest = longest_prompt_tokens(self.cfg, self.tokenizer, self.formatter.format, log=self.log)
            return build_vllm_engine(self.cfg, self.model, self.tokenizer, self.formatter.format, gsm8k_reward,
                                     work_dir=self.run_dir / "vllm" / "sync", track_source=True, longest_prompt=longest)
        return HFRolloutEngine(self.model, self.tokenizer, self.formatter.format, gsm8k_reward, device=self.device,
                               compute_dtype=self.cfg.actor.dtype, log=self.log)  # its progress lines: the run's log

    @staticmethod
    def _load_split(ds, key: str = "train_dataset") -> list:
        try:
            return load_examples(ds.path, ds.split, synthetic_task=ds.synthetic.task,
                                 max_operand=ds.synthetic.max_operand, train_size=ds.synthetic.train_size,
                                 test_size=ds.synthetic.test_size, seed=ds.synthetic.seed,
                                 question_style=ds.synthetic.question_style,
                                 holdout=ds.synthetic.holdout)
        except (FileNotFoundError, ValueError) as e:  # a data problem the user fixes: named by its key, one line
            raise UserError(f"{key}.path={ds.path!r} (split {ds.split!r}): {e}") from e

    def _filter_by_prompt_tokens(self, examples: list, ds, key: str) -> list:
        """Drop examples whose formatted prompt is longer than ``max_length`` tokens."""
        if ds.max_length is None:
            return examples
        kept = [e for e in examples
                if len(self.tokenizer(self.formatter.format(e.question), add_special_tokens=False)["input_ids"])
                <= ds.max_length]
        if not kept:
            raise UserError(f"{key}.max_length={ds.max_length} drops every example of {ds.path!r}; raise it")
        return kept

    def evaluate(self) -> dict[str, float]:
        """The evaluation of the current weights (eval_gconfig on valid_dataset), through the source: in place
        (its row gets eval/accuracy now) or on a rollout worker (merged into the row when it finishes; {} now)."""
        return self.source.evaluate(self.step)

    def run_warm_start(self) -> dict[str, float]:
        """The supervised warm start; adaptive (warm_start.target_accuracy > 0) on a held-out training slice."""
        ws, g = self.cfg.warm_start, self.cfg.eval_gconfig
        sft_examples, accuracy = self.train_examples, None
        if ws.target_accuracy > 0 and ws.steps > 0:
            if ws.eval_problems >= len(self.train_examples):
                raise ValueError(f"warm_start.eval_problems={ws.eval_problems} holds out all "
                                 f"{len(self.train_examples)} training examples; lower it (or raise "
                                 "train_dataset.synthetic.train_size)")
            held = self.train_examples[-ws.eval_problems:]
            # Repeated problems leave the supervised data too: the check measures answers the model was not shown.
            held_q = {e.question for e in held}
            sft_examples = [e for e in self.train_examples if e.question not in held_q]
            if not sft_examples:
                raise ValueError(f"warm_start.eval_problems={ws.eval_problems}: the held-out problems cover every "
                                 "training problem; lower it")
            bs = self.cfg.valid_dataset.batch_size

            def accuracy() -> float:  # greedy: deterministic and no RNG draw, so the SFT stream is unchanged
                if hasattr(self.engine, "source_model"):  # vLLM holds its own copy: install the current weights
                    if getattr(self.engine, "llm", None) is None:
                        self.engine.set_version(self.step)
                    else:
                        self.engine.load_weights(self.model.state_dict(), self.step)
                correct = 0.0
                for i in range(0, len(held), bs):
                    chunk = held[i:i + bs]
                    out = self.engine.generate([e.question for e in chunk], [e.final for e in chunk], n_samples=1,
                                               max_new_tokens=g.max_new_tokens, greedy=True)
                    correct += float(out.rewards.sum())
                return correct / len(held)
        return warm_start(self.model, self.tokenizer, self.formatter.format, self.formatter.sft_target, sft_examples,
                          steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, seed=self.cfg.seed, log=self.log,
                          target_accuracy=ws.target_accuracy, eval_interval=ws.eval_interval, accuracy=accuracy)

    def checkpoint_state(self) -> dict[str, Any]:
        """The loop's state and the source's (merged at the top level: the keys every checkpoint has had)."""
        return self.source.checkpoint_state(self._loop_state)

    def _loop_state(self, actor_state: Optional[dict[str, Any]]) -> dict[str, Any]:
        """``actor_state``: the actor's state when the source gathered it already (sharded train ranks)."""
        return {"actor": self.actor.state_dict() if actor_state is None else actor_state, "rng": capture_rng_state(),
                "dataset": self.dataset.state_dict(), "step": self.step, "warm_start_done": self.warm_start_done}

    def restore(self, state: dict[str, Any]) -> None:
        self.actor.load_state_dict(state["actor"])
        self.dataset.load_state_dict(state["dataset"])
        self.step = int(state["step"])
        self.warm_start_done = bool(state["warm_start_done"])
        self.source.load_state_dict(state, self.step)
        restore_rng_state(state["rng"])

    resume_rows: Optional[list] = None  # set by maybe_recover: the metrics lines its checkpoint recorded

    def maybe_recover(self) -> Optional[int]:
        mode = self.cfg.recover.mode
        if mode == "disabled":
            return None
        # Every checkpoint unusable: refuse (never a silent fresh start); damaged ones skipped are set aside, kept.
        found = load_latest_checkpoint(self.run_dir, refuse_all_invalid=True, set_aside_invalid=True)
        if found is None:
            if mode == "resume":
                raise UserError(f"recover.mode=resume but no checkpoint under {self.run_dir / 'checkpoints'}; "
                                "use recover.mode=auto to start fresh when none exists")
            return None
        step, state = found
        if step >= self.total_steps:  # never a silent no-op (stalerl.training.trial_dir refuses this earlier when it can)
            raise UserError(f"trial {self.run_dir} has a checkpoint at step {step} and this run ends at step "
                            f"{self.total_steps}: nothing to train. Raise total_train_steps to extend it, use a new "
                            "trial_name, or recover.mode=disabled to start over")
        self.restore(state)
        self.on_disk_step = step
        self.resume_rows = state.get("metrics_rows")  # its step's metrics lines, should the file have lost them
        self.log(f"resumed from checkpoint at step {step} ({self.run_dir})")
        return step

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        try:
            self.source.start()  # worker processes, if the source has any: before recovery and warm start
            return self._train()
        except BaseException as exc:
            # A divergence found here is the run's outcome: no worker failure (a rank that followed it down) replaces it
            cause = None if isinstance(exc, TrainingDiverged) else self.source.failure_cause(exc)
            if cause is not None:
                reason = divergence_reason(cause)
                if reason is not None:  # a train worker's loss refused non-finite values: the run diverged
                    logger = getattr(self, "metrics_logger", None)
                    if logger is not None:
                        logger.close()
                    raise TrainingDiverged(self.step + 1, reason) from cause
                raise cause from exc
            raise
        finally:
            self.source.shutdown()

    def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        resumed = self.maybe_recover()
        if resumed is None:
            self._set_aside_previous_metrics()
        logger = self.source.wrap_logger(open_metrics_logger(self.run_dir, cfg, resume_step=resumed,
                                                             resume_rows=self.resume_rows, log=self.log))
        self.metrics_logger = logger
        if not self.warm_start_done:
            summary = self.run_warm_start()
            self.warm_start_done = True
            self.excluded_s += summary.get("warm_start/seconds", 0.0)
            if cfg.evaluator.at_start and cfg.evaluator.freq_steps:
                t_eval = time.perf_counter()
                summary.update(self.evaluate())
                self.excluded_s += time.perf_counter() - t_eval
            logger.log(0, summary)
            self.log(format_summary(0, summary, ("warm_start/final_loss", "eval/accuracy")))
        self.source.on_training_start(self.step)
        # SIGTERM/SIGINT: stop at the end of the step in progress (stalerl.core.interrupt); from the end of the last
        # step on (its checkpoint, the final model, finished.json) neither a signal nor the grace timer cuts the run
        # short: it ends finished, with its marker (interrupt.shielded, entered on `final`).
        with interrupt.deferred(), contextlib.ExitStack() as final:
            return self._train_steps(logger, resumed, final)

    def _train_steps(self, logger: MetricsLogger, resumed: Optional[int],
                     final: contextlib.ExitStack) -> dict[str, Any]:
        cfg = self.cfg
        if self.step >= self.total_steps:  # resumed at the end: only the final save is left
            final.enter_context(interrupt.shielded())
        progress = Progress(self.total_steps, enabled=cfg.stats_logger.progress_bar, initial=self.step)
        last: dict[str, Any] = {}
        startup_s = time.time() - self.launch_time - self.excluded_s
        self.last_saved_at = time.monotonic()
        while self.step < self.total_steps:
            self._keep_last_step()
            try:
                last, startup_s = self._one_step(logger, progress, final, startup_s)
            except interrupt.RunInterrupted as stop:
                if not stop.abandoned:
                    raise
                self._stop_with_last_step(stop, logger, progress)
        progress.close()
        self.source.log_finished_evaluations(logger, wait=True)
        logger.close()
        if cfg.recover.mode != "disabled" and self.on_disk_step != self.step:
            self.save_checkpoint()  # the last step too, so a finished trial can be extended from where it ended
        if cfg.saver.save_final:
            self.save_model(self.run_dir / "final_model")
        trial_dir.write_finished(self.run_dir, step=self.step, total_steps=self.total_steps,
                                 steps_per_epoch=self.steps_per_epoch())
        return last

    def _one_step(self, logger: MetricsLogger, progress: Progress, final: contextlib.ExitStack,
                  startup_s: Optional[float]) -> tuple[dict[str, Any], Optional[float]]:
        """One step: train, evaluate when due, log, checkpoint when due, stop when a signal asked for it. Returns
        its row and the start-up time still to log (None once logged)."""
        cfg = self.cfg
        try:
            last = self.train_step()
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is a divergence (by its type)
            reason = divergence_reason(exc)
            if reason is None:
                raise
            logger.close()
            raise TrainingDiverged(self.step + 1, reason) from exc
        bad = nonfinite(last)
        if bad:  # logged (the curves end here), never evaluated or checkpointed
            logger.log(self.step, last)
            logger.close()
            raise TrainingDiverged(self.step, ", ".join(bad))
        if self.step >= self.total_steps:
            final.enter_context(interrupt.shielded())
        if startup_s is not None:  # seconds from launch to the first step, warm start and eval excluded
            last["timing/startup_overhead_s"] = startup_s
            startup_s = None
        step = self.step
        if cfg.evaluator.freq_steps and (step % cfg.evaluator.freq_steps == 0 or step == self.total_steps):
            t_eval = time.perf_counter()
            last.update(self.evaluate())
            last["timing/eval_s"] = time.perf_counter() - t_eval  # asynchronous: the time to hand it off
        logger.log(step, last)
        self.source.log_finished_evaluations(logger, wait=False)
        progress.update(step, last)
        if cfg.stats_logger.log_every and step % cfg.stats_logger.log_every == 0:
            self.log(format_summary(step, last, (*SUMMARY_KEYS, *loss_fraction_keys(last), "timing/step_s")))
        saved = self.checkpoint_due(step)
        if saved:
            self.save_checkpoint()
        if interrupt.stop_requested() is not None and step < self.total_steps:
            self._stop_for_signal(logger, progress, saved=saved)
        return last, startup_s

    def checkpoint_due(self, step: int) -> bool:
        """recover.freq_steps, or recover.freq_minutes since the last checkpoint (when checkpoints are on)."""
        rc = self.cfg.recover
        if rc.mode == "disabled":
            return False
        if rc.freq_steps and step % rc.freq_steps == 0:
            return True
        return bool(rc.freq_minutes) and time.monotonic() - self.last_saved_at >= rc.freq_minutes * 60.0

    def _keep_last_step(self) -> None:
        """At a step boundary: keep the completed step's state (stalerl.training.last_step) unless it is on disk
        already, checkpoints are off, or the actor is sharded (its state is a collective)."""
        self.boundary_step = self.step
        if (self.cfg.recover.mode == "disabled" or self.on_disk_step == self.step
                or getattr(self.actor, "sharded", False) or getattr(self.source, "fsdp", False)):
            self.last_step.clear()
            return
        state = self.source.snapshot_state(self._loop_state, LIVE)
        logger = getattr(self, "metrics_logger", None)
        state["metrics_rows"] = logger.rows_of(self.step) if logger is not None else []
        self.last_step.keep(self.step, state)

    def _stop_with_last_step(self, stop: interrupt.RunInterrupted, logger: MetricsLogger, progress: Progress) -> None:
        """The step in progress was cut (the grace ran out, or a worker it needed stopped): write the checkpoint of
        the last completed step from its snapshot, so a resume repeats only the cut step, and stop. Shielded: a
        repeated signal (a second or more later) still stops at once, leaving the previous checkpoint intact."""
        with interrupt.shielded():
            progress.close()
            self.source.abandon_logger(logger)
            if self.on_disk_step is not None and self.on_disk_step >= self.step:
                # the step ended and its checkpoint was written before the cut (e.g. in an evaluation's wait)
                raise interrupt.stop_now(stop.signum, step=self.step, checkpoint_step=self.on_disk_step)
            if self.last_step.held:
                step = self.last_step.step
                self.save_checkpoint(step=step, state=self.last_step.state(self.actor.state_dict))
                raise stop.saved(step, step)
            if self.on_disk_step is not None and self.on_disk_step == self.boundary_step:
                raise stop.saved(self.boundary_step, self.on_disk_step)  # on disk already: nothing was kept
            why = ("recover.mode=disabled" if self.cfg.recover.mode == "disabled" else
                   "recover.last_step_copy=false: the update had started" if self.last_step.dropped_for_update else
                   "a sharded actor keeps no snapshot of its last step")
            raise interrupt.RunInterrupted(stop.signum, step=self.boundary_step, note=f"{stop.note} ({why})",
                                           abandoned=True)

    def _stop_for_signal(self, logger: MetricsLogger, progress: Progress, *, saved: bool) -> None:
        """A SIGTERM/SIGINT arrived during this step: checkpoint it (the same checkpoint a periodic one of this step
        is, so a resume continues exactly), then stop with RunInterrupted."""
        progress.close()
        # Evaluations still running (the asynchronous source's, on rollout workers) end first, within the grace:
        # their rows are written whole, so no row is held back in the checkpoint and written again on resume. The
        # logger stays open until the checkpoint is saved (saving merges finished evaluations into it).
        self.source.log_finished_evaluations(logger, wait=True)
        if self.cfg.recover.mode == "disabled":
            logger.close()
            raise interrupt.stop_now(step=self.step, note="no final checkpoint (recover.mode=disabled)")
        if not saved or self.source.saved_with_held_rows:  # again when this step's periodic one held rows now written
            self.save_checkpoint()
        logger.close()
        raise interrupt.stop_now(step=self.step, checkpoint_step=self.step)

    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.cfg.train_dataset, len(self.train_examples))

    def save_checkpoint(self, *, step: Optional[int] = None, state: Optional[dict[str, Any]] = None) -> None:
        """An atomic checkpoint of this step (or of ``step`` from its kept ``state``: stalerl.training.last_step); its
        meta.json records the config and step plan for the next run."""
        meta = {"config": trial_dir.config_dict(self.cfg), "total_steps": self.total_steps,
                "steps_per_epoch": self.steps_per_epoch()}
        if state is None:
            step, state = self.step, self.checkpoint_state()
            logger = getattr(self, "metrics_logger", None)
            state["metrics_rows"] = logger.rows_of(self.step) if logger is not None else []
        save_checkpoint(self.run_dir, step, state, keep_last=self.cfg.recover.keep_last, meta_extra=meta)
        self.on_disk_step = step
        self.last_saved_at = time.monotonic()
        if step == self.last_step.step:
            self.last_step.clear()

    def _set_aside_previous_metrics(self) -> None:
        """A fresh start in a used run directory keeps the old metrics under another name instead of mixing them."""
        old = self.run_dir / "metrics.jsonl"
        if old.exists():
            aside = old.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            old.rename(aside)
            self.log(f"fresh start: previous metrics moved to {aside}")

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        logp0 = self.actor.logp_seconds
        batch = self.source.next_batch(self.step)
        fetch_s = time.perf_counter() - t0
        logp_fetch = self.actor.logp_seconds - logp0  # actor.behavior_logp=recompute
        stale = staleness_stats(batch, self.step)
        advantages = self.advantages(batch)
        t1 = time.perf_counter()
        opt0 = self.actor.optimizer_seconds
        self.last_step.freeze(self.actor.state_dict)  # the weights and optimizer change from here on
        metrics = self.update_actor(batch, advantages)
        t_train = time.perf_counter() - t1
        times = StepTimes(start=t0, fetch_s=fetch_s, logp_fetch_s=logp_fetch, train_s=t_train,
                          logp_train_s=self.actor.logp_seconds - logp0 - logp_fetch,  # a batch selector's pass
                          optimizer_s=self.actor.optimizer_seconds - opt0)
        self.step += 1
        self.source.after_update(self.step)
        return self.source.step_row(metrics, batch, stale, self.batch_metrics(batch), times, self.step)

    def update_actor(self, batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
        """The actor's update of this step, with actor.skip_zero_advantage_groups applied first (skip/* metrics)."""
        if not self.cfg.actor.skip_zero_advantage_groups:
            return self._update(batch, advantages)
        zero = zero_advantage_rows(advantages, batch.response_mask, batch.group_ids)
        if bool(zero.all()) and not self.source.can_skip_whole_step():
            zero = torch.zeros_like(zero)  # data-parallel ranks must all step: train it all (a zero gradient anyway)
        n_groups = int(torch.unique(batch.group_ids).numel())
        n_skipped = float(torch.unique(batch.group_ids[zero]).numel())
        tokens = float(batch.response_mask.sum())
        skipped = {"skip/groups": n_skipped, "skip/group_fraction": n_skipped / max(1, n_groups),
                   "skip/rows": float(zero.sum()),
                   "skip/token_fraction": float(batch.response_mask[zero].sum()) / max(1.0, tokens)}
        if not bool(zero.any()):
            return {**self._update(batch, advantages), **skipped}
        if bool(zero.all()):
            return {**self.actor.skip_update(), **skipped}
        keep = (~zero).nonzero().squeeze(1).tolist()
        return {**self._update(batch.select(keep), advantages[keep]), **skipped}

    def _update(self, batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
        return self.source.update(self.actor, batch, advantages)

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """Shaped rewards, then GRPO advantages broadcast over each response's tokens."""
        a = self.cfg.actor
        rewards = shaped_rewards(batch.rewards, batch.group_ids, scaling=a.reward_scaling, bias=a.reward_bias,
                                 norm=a.reward_norm)
        return grpo_advantages(rewards, batch.group_ids, batch.response_mask, adv_norm=a.adv_norm)

    @staticmethod
    def batch_metrics(batch: RolloutBatch) -> dict[str, float]:
        r = batch.rewards
        _, inv = torch.unique(batch.group_ids, return_inverse=True)
        n_groups = int(inv.max()) + 1 if inv.numel() else 0
        gmax = torch.full((n_groups,), -float("inf")).scatter_reduce(0, inv, r, "amax")
        gmin = torch.full((n_groups,), float("inf")).scatter_reduce(0, inv, r, "amin")
        # "reward" is kept as an alias of "reward/consumed" (the batch trained on, generated `staleness` versions
        # earlier) for existing plots and sweep tables; "reward/generated" is logged by the train steps.
        mean_r = float(r.mean()) if r.numel() else 0.0
        return {
            "reward": mean_r,
            "reward/consumed": mean_r,
            "accuracy": float((r >= 1.0).float().mean()) if r.numel() else 0.0,
            "groups_with_signal": float((gmax > gmin).float().mean()) if n_groups else 0.0,
            "response_length": float(batch.response_mask.sum(dim=1).float().mean()) if r.numel() else 0.0,
            # Mean -log p of the sampled tokens under the policy that sampled them: an unbiased estimate of that
            # policy's per-token entropy (at temperature 1) with no vocabulary-wide pass.
            "rollout/entropy": (float(-batch.behavior_logp[batch.response_mask].mean())
                                if bool(batch.response_mask.any()) else 0.0),
        }

    def save_model(self, path: os.PathLike) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Writing model shards" bar is noise on the console and in logs
        try:
            self.model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        finally:
            hf_logging.enable_progress_bar()


def run(cfg: ExperimentConfig) -> dict[str, Any]:
    return Trainer(cfg).train()
