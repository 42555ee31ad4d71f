"""The training loop, top to bottom: build everything from the config, warm start, then
generate -> (stale FIFO) -> reward/advantage -> registered loss update -> log / evaluate / checkpoint.

This is the synchronous and fixed-staleness loop (rollout.max_head_offpolicyness = 0). Rollout and training share
one process and one model here, so the engine always samples from the trainer's current weights.
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
from stalerl.config.rules import resolve_rollout_backend
from stalerl.core import interrupt
from stalerl.core.errors import NotAvailableError, UserError
from stalerl.data import PromptDataset, load_examples
from stalerl.data.fit import check_data_fits
from stalerl.results.metrics_log import MetricsLogger, Progress, format_summary
from stalerl.core.model import PromptFormatter, load_policy_from_config, resolve_device
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.batch import RolloutBatch
from stalerl.rollout.engine import HFRolloutEngine, evaluate_engine, generation_seed
from stalerl.training.mismatch import engine_mismatch
from stalerl.training.staleness import StaleFIFO, staleness_stats
from stalerl.training import trial_dir
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


def nonfinite(metrics: dict[str, Any], keys=DIVERGENCE_KEYS) -> list[str]:
    """``key=value`` for each of ``keys`` that is present and not finite."""
    out = []
    for k in keys:
        v = metrics.get(k)
        if isinstance(v, float) and not np.isfinite(v):
            out.append(f"{k}={v}")
    return out
SUMMARY_KEYS = ("reward", "eval/accuracy", "eval/accuracy_subset", "actor/loss", "actor/grad_norm", "staleness/avg",
                "actor/m2po/masked_fraction", "actor/vanilla/clip_fraction", "timing/step_s")


EVAL_SUBSET_SEED = 0  # the same subset in every run (any seed, any loss) on the same evaluation data


def eval_subset(examples: list, n: Optional[int]) -> Optional[list]:
    """evaluator.n_prompts_during_training: a fixed subset of ``n`` of ``examples`` (seeded by EVAL_SUBSET_SEED, not
    the run's seed, so runs compare on the same problems; in their original order), or None when ``n`` is null or
    covers them all. Drawn with its own generator: no global random state moves."""
    if n is None or n >= len(examples):
        return None
    keep = sorted(random.Random(EVAL_SUBSET_SEED).sample(range(len(examples)), n))
    return [examples[i] for i in keep]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def steps_per_epoch(cfg: ExperimentConfig, num_train_examples: int) -> int:
    per_epoch = num_train_examples // cfg.train_dataset.batch_size
    if not cfg.train_dataset.drop_last and num_train_examples % cfg.train_dataset.batch_size:
        per_epoch += 1
    return per_epoch


def total_steps(cfg: ExperimentConfig, num_train_examples: int) -> int:
    steps = steps_per_epoch(cfg, num_train_examples) * cfg.total_train_epochs
    if cfg.total_train_steps is not None:
        steps = min(steps, cfg.total_train_steps) if steps > 0 else cfg.total_train_steps
    return max(0, steps)


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


class Trainer:
    saved_with_held_rows = False  # the last checkpoint held metric rows back (only the asynchronous trainer holds any)
    eval_subset: Optional[list] = None  # evaluator.n_prompts_during_training's subset (None: all evaluations full)

    def __init__(self, cfg: ExperimentConfig, *, log=print):
        self.launch_time = float(os.environ.get(LAUNCH_TIME_ENV, time.time()))
        self.excluded_s = 0.0  # warm start and evaluation: work, not start-up overhead
        self.cfg = cfg
        self.log = log
        # rollout.backend=auto:dX becomes hf:dX or vllm:dX here, with one line saying which and why, before the
        # config is saved: config.yaml, checkpoints, the summary and the workers all record the engine that ran.
        resolve_rollout_backend(cfg, log=self.log)
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
        self.total_steps = total_steps(cfg, len(self.train_examples))
        self.actor = Actor(self.model, cfg.actor, temperature=cfg.gconfig.temperature,
                           total_updates=self.total_steps * cfg.actor.ppo_n_minibatches,
                           loss_scale_factor=cfg.gconfig.max_new_tokens, correction=correction_params(cfg))
        if not self.actor.chunked_logprobs:  # once, at start (stalerl.core.chunked_logprob.chunked_logprob_check)
            self.log(f"stalerl: log-probs use the plain logits path, not the chunked head: "
                     f"{self.actor.chunked_logprobs_reason} (each update records actor/chunked_logprobs=0)")
        self.engine = self._build_engine()
        self.fifo = StaleFIFO(cfg.rollout.fixed_staleness)
        self.step = 0  # optimizer steps taken = the trainer's weight version
        self.tasks_generated = 0  # prompt groups generated so far; seeds each generate call (see generation_seed)
        self.warm_start_done = False
        self._gen_rewards: list[torch.Tensor] = []  # rewards of the batches generated during the current step
        self._mismatch: dict[str, float] = {}  # stats_logger.mismatch_freq_steps: this step's mismatch/* metrics
        self._mismatch_step = -1  # the step whose fresh data was last probed
        self._probe_seconds = 0.0
        self._gen_seconds, self._gen_tokens = 0.0, 0  # this step's generation time and tokens (train_step resets)

    # ------------------------------------------------------------------ pieces
    def _build_engine(self):
        """The synchronous loop's engine. vLLM holds its own copy of the weights: it starts from the trainer's
        module at the first generation (after warm start or a resume) and is re-synced when the step moves on."""
        if self.engine_name == "vllm" and not self._rollout_in_workers():
            from stalerl.rollout.vllm_engine import build_vllm_engine

            return build_vllm_engine(self.cfg, self.model, self.tokenizer, self.formatter.format, gsm8k_reward,
                                     work_dir=self.run_dir / "vllm" / "sync", track_source=True)
        return HFRolloutEngine(self.model, self.tokenizer, self.formatter.format, gsm8k_reward, device=self.device,
                               compute_dtype=self.cfg.actor.dtype)

    def _rollout_in_workers(self) -> bool:
        """The asynchronous trainer generates in rollout workers (it keeps an HF engine for evaluation only)."""
        return False

    def _engine_kwargs(self, first_task_id: int, n_prompts: int, n_samples: int) -> dict:
        """vLLM: per-prompt seeds when rollout.vllm.seeded_requests asks for them, else nothing (vLLM's batched
        sampler). The HF engine is seeded through the global RNG by the caller."""
        if not hasattr(self.engine, "source_model"):
            return {}
        from stalerl.rollout.vllm_engine import generate_kwargs

        return generate_kwargs(self.cfg, range(first_task_id, first_task_id + n_prompts), n_samples)

    @staticmethod
    def _load_split(ds, key: str = "train_dataset") -> list:
        try:
            return load_examples(ds.path, ds.split, synthetic_task=ds.synthetic.task,
                                 max_operand=ds.synthetic.max_operand, train_size=ds.synthetic.train_size,
                                 test_size=ds.synthetic.test_size, seed=ds.synthetic.seed,
                                 question_style=ds.synthetic.question_style)
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

    def generate_batch(self) -> RolloutBatch:
        g = self.cfg.gconfig
        examples = self.dataset.next_batch()
        self.engine.set_version(self.step)
        # Seeded by the first task id, as the asynchronous workers do: with max_head_offpolicyness=0 both loops
        # sample exactly the same tokens.
        torch.manual_seed(generation_seed(self.cfg.seed, self.tasks_generated))
        seeds = self._engine_kwargs(self.tasks_generated, len(examples), g.n_samples)
        self.tasks_generated += len(examples)
        batch = self.engine.generate([e.question for e in examples], [e.final for e in examples],
                                     n_samples=g.n_samples, max_new_tokens=g.max_new_tokens,
                                     temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, **seeds)
        if self.cfg.actor.behavior_logp == "recompute":
            # The authors' choice: behaviour log-probs from the training engine at the generating weights (which
            # are the current weights at generation time in this loop), so train/infer mismatch stays out of M2.
            recomputed = self.actor.compute_logp(batch)
            if self._mismatch_step_due():
                # the recompute is the trainer's pass at the generating weights: the mismatch comes for free
                self._mismatch_step = self.step
                self._mismatch = engine_mismatch(recomputed, batch.behavior_logp, batch.response_mask)
            batch.set_trainer_logp(recomputed)  # the engine's log-probs stay in batch.engine_logp
        elif self._mismatch_due():
            self._mismatch_step = self.step
            self._mismatch = self.probe_mismatch(self.actor, batch)  # fresh: generated by the weights just trained
        self._gen_rewards.append(batch.rewards)
        self._gen_seconds += self.engine.last_generate_seconds
        self._gen_tokens += batch.num_response_tokens
        return batch

    def _mismatch_step_due(self) -> bool:
        """Once per stats_logger.mismatch_freq_steps steps, on the first batch generated at that step."""
        freq = self.cfg.stats_logger.mismatch_freq_steps
        return bool(freq) and self.step % freq == 0 and self._mismatch_step != self.step

    def _mismatch_due(self) -> bool:
        """stalerl.training.mismatch's probe (an extra no-grad pass): due at such a step when the behaviour log-probs
        are the engine's (behavior_logp=rollout; with recompute the recompute pass gives the mismatch)."""
        return self.cfg.actor.behavior_logp == "rollout" and self._mismatch_step_due()

    def probe_mismatch(self, actor: Actor, batch: RolloutBatch) -> dict[str, float]:
        """The mismatch/* metrics of ``batch`` (generated by ``actor``'s current weights). A no-grad pass that draws
        no random number; its time goes to timing/mismatch_probe_s, not to the log-prob split."""
        start, logp_seconds = time.perf_counter(), actor.logp_seconds
        cap = self.cfg.stats_logger.mismatch_max_rows
        if cap is not None and batch.num_rows > cap:
            batch = batch.select(list(range(cap)))
        trainer_logp = actor.compute_logp(batch)
        actor.logp_seconds = logp_seconds
        out = engine_mismatch(trainer_logp, batch.behavior_logp, batch.response_mask)
        self._probe_seconds += time.perf_counter() - start
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy (eval_gconfig) accuracy on valid_dataset with this process's engine at the current weights. The
        asynchronous trainer overrides it: there a rollout worker evaluates while training goes on."""
        if hasattr(self.engine, "source_model"):  # vLLM keeps its own weights: bring them to this step's
            self.engine.set_version(self.step)
        examples = self.eval_examples(self.step)
        out = evaluate_engine(self.engine, examples, self.cfg.eval_gconfig, self.cfg.valid_dataset.batch_size)
        return self.eval_metrics(out["accuracy"], self.step)

    def eval_is_full(self, version: int) -> bool:
        """Whether the evaluation of weights ``version`` uses every evaluation prompt: always without
        evaluator.n_prompts_during_training; with it, at step 0 (evaluator.at_start) and at the last step only."""
        return self.eval_subset is None or version <= 0 or version >= self.total_steps

    def eval_examples(self, version: int) -> list:
        return self.valid_examples if self.eval_is_full(version) else self.eval_subset

    def eval_metrics(self, accuracy: float, version: int) -> dict[str, float]:
        """The metric names of an evaluation: eval/accuracy for a full one (the only name the run summary and the
        study report read), eval/accuracy_subset for a subset one; eval/n_prompts beside either when a subset is
        configured (without one the row is exactly what it always was)."""
        if self.eval_subset is None:
            return {"eval/accuracy": accuracy}
        full = self.eval_is_full(version)
        return {"eval/accuracy" if full else "eval/accuracy_subset": accuracy,
                "eval/n_prompts": float(len(self.eval_examples(version)))}

    def wrap_logger(self, logger: MetricsLogger) -> MetricsLogger:
        """The metrics logger the loop writes through (the asynchronous trainer holds rows back until their
        evaluation, which runs on a rollout worker, has finished). Here: the logger itself."""
        return logger

    def log_finished_evaluations(self, logger: MetricsLogger, *, wait: bool) -> None:
        """Write what evaluations that finished since the last call complete; ``wait``: the end of training, every
        requested evaluation is waited for. Nothing to do here: this loop evaluates in place."""

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

    def checkpoint_state(self, actor_state: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """``actor_state``: the actor's state when the caller already gathered it (sharded actors)."""
        return {"actor": self.actor.state_dict() if actor_state is None else actor_state,
                "rng": capture_rng_state(), "dataset": self.dataset.state_dict(),
                "fifo": self.fifo.state_dict(), "step": self.step, "warm_start_done": self.warm_start_done,
                "tasks_generated": self.tasks_generated}

    def restore(self, state: dict[str, Any]) -> None:
        self.actor.load_state_dict(state["actor"])
        self.dataset.load_state_dict(state["dataset"])
        self.fifo.load_state_dict(state["fifo"])
        self.step = int(state["step"])
        self.warm_start_done = bool(state["warm_start_done"])
        self.tasks_generated = int(state["tasks_generated"])
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
        self.resume_rows = state.get("metrics_rows")  # its step's metrics lines, should the file have lost them
        self.log(f"resumed from checkpoint at step {step} ({self.run_dir})")
        return step

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        resumed = self.maybe_recover()
        if resumed is None:
            self._set_aside_previous_metrics()
        logger = self.wrap_logger(MetricsLogger(self.run_dir, tensorboard=cfg.stats_logger.tensorboard,
                                                resume_step=resumed, resume_rows=self.resume_rows, log=self.log))
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
        self.on_training_start()
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
        while self.step < self.total_steps:
            try:
                last = self.train_step()
            except ValueError as exc:  # the loss refuses non-finite log-probs on valid tokens (recipe.common)
                if "non-finite" not in str(exc):
                    raise
                logger.close()
                raise TrainingDiverged(self.step + 1, str(exc).splitlines()[0][:300]) from exc
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
            self.log_finished_evaluations(logger, wait=False)
            progress.update(step, last)
            if cfg.stats_logger.log_every and step % cfg.stats_logger.log_every == 0:
                self.log(format_summary(step, last, SUMMARY_KEYS))
            saved = cfg.recover.mode != "disabled" and cfg.recover.freq_steps and step % cfg.recover.freq_steps == 0
            if saved:
                self.save_checkpoint()
            if interrupt.stop_requested() is not None and step < self.total_steps:
                self._stop_for_signal(logger, progress, saved=bool(saved))
        progress.close()
        self.log_finished_evaluations(logger, wait=True)
        logger.close()
        if cfg.recover.mode != "disabled" and resumed != self.step and self.step % cfg.recover.freq_steps:
            self.save_checkpoint()  # the last step too, so a finished trial can be extended from where it ended
        if cfg.saver.save_final:
            self.save_model(self.run_dir / "final_model")
        trial_dir.write_finished(self.run_dir, step=self.step, total_steps=self.total_steps,
                                 steps_per_epoch=self.steps_per_epoch())
        return last

    def _stop_for_signal(self, logger: MetricsLogger, progress: Progress, *, saved: bool) -> None:
        """A SIGTERM/SIGINT arrived during this step: checkpoint it (the same checkpoint a periodic one of this step
        is, so a resume continues exactly), then stop with RunInterrupted."""
        progress.close()
        # Evaluations still running (the asynchronous trainer's, on rollout workers) end first, within the grace:
        # their rows are written whole, so no row is held back in the checkpoint and written again on resume. The
        # logger stays open until the checkpoint is saved (saving merges finished evaluations into it).
        self.log_finished_evaluations(logger, wait=True)
        if self.cfg.recover.mode == "disabled":
            logger.close()
            raise interrupt.stop_now(step=self.step, note="no final checkpoint (recover.mode=disabled)")
        if not saved or self.saved_with_held_rows:  # again when this step's periodic one held rows now written
            self.save_checkpoint()
        logger.close()
        raise interrupt.stop_now(step=self.step, checkpoint_step=self.step)

    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.cfg, len(self.train_examples))

    def save_checkpoint(self) -> None:
        """An atomic checkpoint of this step; its meta.json records the config and step plan for the next run."""
        meta = {"config": trial_dir.config_dict(self.cfg), "total_steps": self.total_steps,
                "steps_per_epoch": self.steps_per_epoch()}
        state = self.checkpoint_state()
        logger = getattr(self, "metrics_logger", None)
        state["metrics_rows"] = logger.rows_of(self.step) if logger is not None else []
        save_checkpoint(self.run_dir, self.step, state, keep_last=self.cfg.recover.keep_last, meta_extra=meta)

    def on_training_start(self) -> None:
        """Hook after warm start or restore, before the first step (the async trainer syncs its workers here)."""

    def _set_aside_previous_metrics(self) -> None:
        """A fresh start in a used run directory keeps the old metrics under another name instead of mixing them."""
        old = self.run_dir / "metrics.jsonl"
        if old.exists():
            aside = old.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            old.rename(aside)
            self.log(f"fresh start: previous metrics moved to {aside}")

    def train_step(self) -> dict[str, Any]:
        self._gen_seconds, self._gen_tokens = 0.0, 0
        self._gen_rewards = []  # reward/generated: this step's fresh batches (under a FIFO, not the consumed one)
        self._mismatch, self._probe_seconds = {}, 0.0
        sync0 = getattr(self.engine, "sync_seconds_total", None)  # vLLM: its weight syncs happen inside generation
        t0 = time.perf_counter()
        logp0 = self.actor.logp_seconds
        batch = self.fifo.next_batch(self.generate_batch)
        t_gen = time.perf_counter() - t0 - self._probe_seconds
        logp_gen = self.actor.logp_seconds - logp0  # actor.behavior_logp=recompute
        advantages = self.advantages(batch)
        stale = staleness_stats(batch, self.step)
        t1 = time.perf_counter()
        opt0 = self.actor.optimizer_seconds
        metrics = self.update_actor(batch, advantages)
        t_train = time.perf_counter() - t1
        t_opt = self.actor.optimizer_seconds - opt0
        logp_train = self.actor.logp_seconds - logp0 - logp_gen  # a batch selector's (M2PO's) no-grad pass
        self.step += 1
        metrics.update(stale)
        metrics.update(self.batch_metrics(batch))
        if self._gen_rewards:
            metrics["reward/generated"] = float(torch.cat(self._gen_rewards).float().mean())
        train_tokens = float(batch.attention_mask().sum())
        metrics.update({
            "timing/gen_s": t_gen, "timing/train_s": t_train, "timing/step_s": time.perf_counter() - t0,
            # the same step cut into three disjoint phases: sampling, no-grad log-prob passes, forward/backward+step
            "timing/split/generation_s": t_gen - logp_gen, "timing/split/logp_s": logp_gen + logp_train,
            "timing/split/training_s": t_train - logp_train,
            # training_s = forward_backward_s + optimizer_s (gradient clipping and the optimizer step)
            "timing/split/forward_backward_s": t_train - logp_train - t_opt, "timing/split/optimizer_s": t_opt,
            "throughput/gen_tokens_per_s": self._gen_tokens / self._gen_seconds if self._gen_seconds else 0.0,
            "throughput/train_tokens_per_s": train_tokens / t_train if t_train else 0.0,
            "version": float(self.step),
        })
        if sync0 is not None:
            metrics["timing/weight_sync_s"] = self.engine.sync_seconds_total - sync0  # part of generation_s
        if self._mismatch:
            metrics.update(self._mismatch)
            metrics["timing/mismatch_probe_s"] = self._probe_seconds
        metrics.update(peak_memory_metrics(self.device))
        return metrics

    def update_actor(self, batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
        """The actor's update of this step, with actor.skip_zero_advantage_groups applied first (skip/* metrics)."""
        if not self.cfg.actor.skip_zero_advantage_groups:
            return self._update(batch, advantages)
        zero = zero_advantage_rows(advantages, batch.response_mask, batch.group_ids)
        if bool(zero.all()) and not self._can_skip_whole_step():
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

    def _can_skip_whole_step(self) -> bool:
        return True

    def _update(self, batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
        return self.actor.update(batch, advantages)

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
