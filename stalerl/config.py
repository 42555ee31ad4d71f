"""Typed experiment configuration: dataclass schema + YAML file + dotted ``key=value`` overrides.

Usage (the entry scripts do this)::

    cfg = load_config()                      # sys.argv[1:]: [--config FILE.yaml] [key=value ...]
    cfg = load_config(["--config", "exp.yaml", "actor.c_clip=3.0", "rollout.max_head_offpolicyness=4"])

Merge order: ``OmegaConf.structured(ExperimentConfig)`` <- YAML <- overrides, so every schema key can be overridden
without ``+`` (``+key=value`` is accepted and means the same thing). ``${...}`` interpolation works
(``rollout.consumer_batch_size`` defaults to ``${train_dataset.batch_size}``).

Everything is checked at load time, before any work starts: unknown keys (with a did-you-mean, also across sections),
types, choice fields, ranges, backend strings and cross-field rules. Every problem is reported in one
:class:`ConfigError` naming the dotted key, the value, what is expected and how to fix it.

Every field carries ``metadata["help"]`` (``--help`` prints them, grouped by section); choice fields also carry
``metadata["choices"]`` and numeric fields their bounds (``ge``/``gt``/``le``/``lt``), which are enforced.
"""

import contextlib
import contextvars
import dataclasses
import difflib
import math
import os
import re
import sys
import tempfile
import typing
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "ActorConfig",
    "Backend",
    "ClusterConfig",
    "ConfigError",
    "ConfigWarning",
    "DatasetConfig",
    "EvaluatorConfig",
    "ExperimentConfig",
    "GenerationConfig",
    "MicroBatchSpec",
    "NormConfig",
    "OptimizerConfig",
    "RecoverConfig",
    "RolloutConfig",
    "SaverConfig",
    "SchedulerConfig",
    "SlurmConfig",
    "StatsLoggerConfig",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "WarmStartConfig",
    "apply_overrides",
    "config_to_yaml",
    "format_help",
    "load_config",
    "parse_args",
    "parse_backend",
    "run_dir",
    "save_resolved_config",
    "schema_keys",
    "validate",
]


class ConfigError(ValueError):
    """A configuration problem found at load time. ``keys`` lists the dotted keys involved (may be empty)."""

    def __init__(self, message: str, keys: Optional[List[str]] = None):
        super().__init__(message)
        self.keys = list(keys or [])


class ConfigWarning(UserWarning):
    """A legal but probably unintended setting (e.g. ``gconfig.top_k`` != 0)."""


# While OmegaConf instantiates the dataclasses, per-section __post_init__ checks are deferred so that `validate`
# can report every problem at once with full dotted keys (``train_dataset.batch_size``, not ``batch_size``).
_DEFER_CHECKS: contextvars.ContextVar = contextvars.ContextVar("stalerl_config_defer_checks", default=False)


@contextlib.contextmanager
def _deferred_checks() -> Iterator[None]:
    token = _DEFER_CHECKS.set(True)
    try:
        yield
    finally:
        _DEFER_CHECKS.reset(token)


def _f(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None, choices: Optional[tuple] = None,
       ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
       lt: Optional[float] = None) -> Any:
    """``dataclasses.field`` with ``metadata={"help": ..., "choices": ..., "ge"/"gt"/"le"/"lt": ...}``."""
    metadata: Dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    for name, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)):
        if bound is not None:
            metadata[name] = bound
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# --------------------------------------------------------------------------------------------------------------------
# Backend strings: "<engine>:d<X>[t<T>][p<P>]"
# --------------------------------------------------------------------------------------------------------------------

ROLLOUT_ENGINES = ("hf", "vllm", "sglang")
TRAIN_ENGINES = ("torch", "fsdp")
_GPU_ROLLOUT_ENGINES = ("vllm", "sglang")


class Backend(NamedTuple):
    """A parsed backend string: engine name and data / tensor / pipeline parallel sizes."""

    engine: str
    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        """Processes (or GPUs, for GPU engines) the backend needs: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        s = f"{self.engine}:d{self.dp}"
        if self.tp != 1:
            s += f"t{self.tp}"
        if self.pp != 1:
            s += f"p{self.pp}"
        return s


_DIM_NAMES = {"d": "data-parallel replicas", "t": "tensor-parallel size", "p": "pipeline stages"}


def parse_backend(s: str, *, engines: Optional[tuple] = None, key: str = "backend") -> Backend:
    """Parse ``"<engine>:d<X>[t<T>][p<P>]"`` (dimensions in any order, each at most once, ``d`` required).

    ``parse_backend("sglang:d2t2") == Backend("sglang", dp=2, tp=2, pp=1)``. ``engines`` restricts the engine names;
    ``key`` is the dotted key named in errors. Raises :class:`ConfigError` with the expected grammar.
    """
    grammar = "'<engine>:d<X>[t<T>][p<P>]', e.g. 'sglang:d2', 'vllm:d1t2', 'torch:d1'"
    engine_hint = f" with engine one of {', '.join(engines)}" if engines else ""

    def fail(why: str) -> ConfigError:
        detail = (f"got {s!r}: {why}. Expected {grammar}{engine_hint}. "
                  f"Fix: use e.g. {(engines or ('hf',))[0]}:d1.")
        err = ConfigError(f"invalid {key}: {detail}", [key])
        err.detail = detail  # type: ignore[attr-defined]
        return err

    if not isinstance(s, str):
        raise fail(f"must be a string, got {type(s).__name__}")
    if "+" in s:
        raise fail("combined allocation strings with '+' are not supported; set rollout.backend and actor.backend "
                   "separately")
    engine, sep, dims = s.strip().partition(":")
    engine = engine.strip().lower()
    if not sep or not engine:
        raise fail("missing '<engine>:' prefix")
    if engines is not None and engine not in engines:
        close = difflib.get_close_matches(engine, engines, n=1)
        raise fail(f"unknown engine {engine!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if not dims:
        raise fail("missing parallel dimensions after ':'")
    pos, sizes = 0, {}
    for m in re.finditer(r"([a-zA-Z])(\d*)", dims):
        if m.start() != pos:
            break
        letter, digits = m.group(1).lower(), m.group(2)
        if letter not in _DIM_NAMES:
            raise fail(f"unknown dimension {m.group(1)!r} (known: d = data-parallel, t = tensor-parallel, "
                       "p = pipeline)")
        if not digits:
            raise fail(f"dimension {letter!r} needs a size, e.g. {letter}2")
        if letter in sizes:
            raise fail(f"dimension {letter!r} given twice")
        size = int(digits)
        if size < 1:
            raise fail(f"{_DIM_NAMES[letter]} must be >= 1, got {size}")
        sizes[letter] = size
        pos = m.end()
    if pos != len(dims):
        raise fail(f"cannot parse {dims[pos:]!r}")
    if "d" not in sizes:
        raise fail("the data-parallel size 'd<X>' is required")
    return Backend(engine, sizes["d"], sizes.get("t", 1), sizes.get("p", 1))


# --------------------------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------------------------


class _Section:
    """Base of every config section: declarative checks (type, choices, bounds) plus ``_check`` for the rest."""

    def __post_init__(self) -> None:
        if _DEFER_CHECKS.get():
            return
        problems = self._problems(type(self).__name__)
        if problems:
            raise ConfigError(_format_problems(problems), [p[0] for p in problems])

    def _problems(self, prefix: str) -> List[Tuple[str, str]]:
        """Problems of this section only (not of nested sections) as (key, message) pairs."""
        out: List[Tuple[str, str]] = []
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            key = f"{prefix}.{f.name}" if prefix else f.name
            msg = _check_value(key, getattr(self, f.name), hints[f.name], f.metadata)
            if msg:
                out.append((key, msg))
        if not out:  # custom checks assume well-typed values
            for key, msg in self._check():
                out.append((f"{prefix}.{key}" if prefix else key, msg))
        return out

    def _check(self) -> List[Tuple[str, str]]:
        """Section-specific checks; keys relative to the section."""
        return []


@dataclass
class ClusterConfig(_Section):
    """Where run outputs go and what hardware the job may use."""

    fileroot: str = _f("./runs", help="Root directory for run outputs; a run writes to "
                                      "{fileroot}/{experiment_name}/{trial_name}. Must be on a shared filesystem "
                                      "for multi-node Ray/Slurm runs.")
    n_nodes: int = _f(1, ge=1, help="Number of nodes.")
    n_gpus_per_node: int = _f(0, ge=0, help="GPUs per node available to this job; 0 = CPU only. vllm/sglang rollout "
                                            "backends need GPUs, and the GPUs the backends ask for must fit in "
                                            "n_nodes * n_gpus_per_node.")


@dataclass
class SlurmConfig(_Section):
    """sbatch settings, used only when scheduler.type=slurm (see stalerl/schedulers/slurm.py)."""

    partition: Optional[str] = _f(None, help="Slurm partition (--partition), or a comma-separated list; null = the "
                                             "cluster default. Letters, digits and _ . + - only.")
    account: Optional[str] = _f(None, help="Slurm account (--account); null = your default account. Letters, digits "
                                           "and _ . + - only.")
    time: str = _f("01:00:00", help="Wall-clock limit (--time), Slurm format [D-]HH:MM:SS, MM:SS or minutes. "
                                    "Quote it in YAML (time: \"1:00:00\"): YAML reads unquoted 1:00:00 as a "
                                    "base-60 integer.")
    mem: str = _f("16G", help="Memory per node (--mem), e.g. 16G, 64000M.")
    cpus_per_task: int = _f(2, ge=1, help="CPUs per task (--cpus-per-task); one task per node, so this is also the "
                                          "Ray CPUs of each node.")
    gpus_per_node: int = _f(0, ge=0, help="GPUs per node (--gres=gpu:N); 0 = no GPU request.")
    nodes: int = _f(1, ge=1, help="Nodes (--nodes). With more than one, a Ray cluster spans them (inner scheduler "
                                  "ray).")
    extra_sbatch_args: List[str] = _f(factory=list, help="Extra sbatch options, each '--name' or '--name=value' "
                                                          "(long form; the value is quoted), e.g. "
                                                          "[--qos=high,--constraint=a100]. Options this scheduler "
                                                          "sets itself (job-name, output, array, nodes, ...) are "
                                                          "refused: use their scheduler.slurm.* keys.")
    dry_run: bool = _f(False, help="Write the sbatch script and print it instead of submitting it (same as "
                                   "--dry-run).")
    wait: bool = _f(True, help="Wait for the job, report its state, log tail and start-up time; false = return "
                               "right after submission (the job id and log path are printed). Sweeps always wait: "
                               "their summary table needs the results.")
    inner_scheduler: Optional[str] = _f(None, choices=("local", "ray"),
                                        help="scheduler.type of the run inside the allocation. ray = a Ray cluster "
                                             "is started across the allocated nodes (needed for nodes > 1); local = "
                                             "worker processes on the first node, no Ray. null = ray for a single "
                                             "job, local for each task of a sweep's job array (self-contained "
                                             "tasks, no Ray start-up per task).")
    max_parallel: Optional[int] = _f(None, ge=1, help="Sweeps: at most this many array tasks run at once "
                                                      "(--array=0-N%max_parallel); null = as many as fit.")
    python: Optional[str] = _f(None, help="Python executable inside the job; null = the one running the "
                                          "submission (sys.executable). It must see the same stalerl install.")
    poll_interval_s: float = _f(1.0, gt=0.0, help="Seconds between job state polls while waiting.")
    wait_timeout_s: Optional[float] = _f(None, gt=0.0, help="Stop waiting after this many seconds (the job keeps "
                                                            "running; its id is printed); null = wait until it ends.")
    ray_start_timeout_s: float = _f(180.0, gt=0.0, help="Inside the job: seconds to wait for the Ray head and for "
                                                        "every node to join before failing.")
    log_tail_lines: int = _f(40, ge=0, help="Lines of the job log printed when a job fails.")

    def _check(self) -> List[Tuple[str, str]]:
        out: List[Tuple[str, str]] = []
        if (self.partition is not None or self.account is not None or self.python is not None
                or self.extra_sbatch_args or re.search(r"[\x00-\x1f\x7f]", self.time + self.mem)):
            # the validators live with the scheduler; imported only when there is something for them to check
            from stalerl.schedulers.slurm import slurm_config_problems

            out = slurm_config_problems(self)
        bad = {key for key, _ in out}
        if "time" not in bad and not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+|UNLIMITED|INFINITE",
                                                  self.time.strip()):
            out.append(("time", f"got {self.time!r}; expected a Slurm time limit such as 01:00:00, 2-00:00:00, "
                                "90:00 or 120 (minutes). Fix: set scheduler.slurm.time=01:00:00."))
        if "mem" not in bad and not re.fullmatch(r"\d+[KMGT]?B?", self.mem.strip(), flags=re.IGNORECASE):
            out.append(("mem", f"got {self.mem!r}; expected a Slurm memory size such as 16G or 64000M. "
                               "Fix: set scheduler.slurm.mem=16G."))
        return out


@dataclass
class SchedulerConfig(_Section):
    """How worker processes are started."""

    type: str = _f("local", choices=("local", "ray", "slurm"),
                   help="local = processes on this machine; ray = a Ray cluster; slurm = sbatch jobs.")
    ray_address: Optional[str] = _f(None, help="Ray cluster address; null = the RAY_ADDRESS environment variable, "
                                               "else a new local Ray cluster.")
    slurm: SlurmConfig = _f(factory=SlurmConfig, help="Slurm settings (scheduler.type=slurm).")


@dataclass
class RolloutConfig(_Section):
    """The inference side: the generation engine and the staleness (off-policyness) control."""

    backend: str = _f("hf:d1", help="Generation engine and parallelism, '<engine>:d<X>[t<T>][p<P>]' with engine "
                                    "hf (transformers generate, CPU or GPU), vllm or sglang (GPU); d = replicas, "
                                    "t = tensor-parallel, p = pipeline stages. E.g. sglang:d2.")
    max_concurrent_rollouts: Optional[int] = _f(None, ge=1, help="Prompt groups in flight at once; null = "
                                                                  "consumer_batch_size.")
    max_head_offpolicyness: int = _f(0, ge=0, help="How many trainer versions behind a consumed sample's oldest "
                                                   "token may be (admission control, AReaL semantics); 0 = "
                                                   "synchronous on-policy.")
    consumer_batch_size: int = _f("${train_dataset.batch_size}", ge=1,
                                  help="Prompts (groups) consumed per train step.")
    fixed_staleness: int = _f(0, ge=0, help="Controlled-experiment mode: the batch trained at step t is generated "
                                            "by the policy of step t-s (a FIFO, as in the paper's Stale-k runs); "
                                            "0 = off. Do not combine with max_head_offpolicyness > 0.")
    queue_size: Optional[int] = _f(None, ge=1, help="Asynchronous mode: at most this many prompt groups running or "
                                                    "finished-but-unconsumed at once (bounds memory); null = no "
                                                    "cap beyond the staleness and concurrency rules.")
    mode: str = _f("auto", choices=("auto", "sync", "async"),
                   help="sync: rollout and training alternate in one process (with fixed_staleness for controlled "
                        "experiments); async: rollout workers and train workers run concurrently under "
                        "max_head_offpolicyness; auto: async when max_head_offpolicyness > 0 or either backend has "
                        "more than one replica, else sync.")
    weight_sync: str = _f("shared_memory", choices=("shared_memory", "disk"),
                          help="How new weights reach the rollout engine: shared_memory (same machine) or disk "
                               "(a checkpoint under the run directory; works across machines).")

    def _check(self) -> List[Tuple[str, str]]:
        try:
            b = parse_backend(self.backend, engines=ROLLOUT_ENGINES, key="backend")
        except ConfigError as e:
            return [("backend", e.detail)]  # type: ignore[attr-defined]
        if b.engine == "hf" and (b.tp > 1 or b.pp > 1):
            return [("backend", f"got {self.backend!r}; the hf engine supports data parallelism only. "
                                f"Fix: use hf:d{b.dp}, or vllm/sglang for tensor/pipeline parallelism.")]
        return []


@dataclass
class GenerationConfig(_Section):
    """Sampling parameters."""

    n_samples: int = _f(4, ge=1, help="Completions per prompt (the GRPO group size; group-normalised advantages "
                                      "need >= 2).")
    max_new_tokens: int = _f(10, ge=1, help="Maximum generated tokens per completion.")
    temperature: float = _f(1.0, gt=0.0, help="Sampling temperature (> 0; use greedy=true for argmax).")
    top_p: float = _f(1.0, gt=0.0, le=1.0, help="Nucleus sampling mass in (0, 1]; values < 1 make the behaviour "
                                                "log-probs differ from the policy's softmax.")
    top_k: int = _f(0, ge=0, help="Top-k sampling; 0 = off. Anything else makes the behaviour log-probs differ from "
                                  "the policy's softmax (a warning is issued).")
    greedy: bool = _f(False, help="Argmax decoding (evaluation); ignores temperature/top_p/top_k.")


@dataclass
class TinyModelConfig(_Section):
    """Shape of the embedded from-scratch model used when actor.path is tiny:qwen2 or tiny:llama."""

    hidden_size: int = _f(128, ge=1, help="Hidden size.")
    num_hidden_layers: int = _f(2, ge=1, help="Transformer layers.")
    num_attention_heads: int = _f(4, ge=1, help="Attention heads (must divide hidden_size).")
    num_key_value_heads: int = _f(4, ge=1, help="Key/value heads (must divide num_attention_heads).")
    intermediate_size: int = _f(512, ge=1, help="MLP intermediate size.")
    max_position_embeddings: int = _f(256, ge=1, help="Maximum sequence length (prompt + completion).")

    def _check(self) -> List[Tuple[str, str]]:
        out = []
        if self.hidden_size % self.num_attention_heads:
            out.append(("num_attention_heads", f"got {self.num_attention_heads}; must divide hidden_size="
                                               f"{self.hidden_size}. Fix: pick a divisor, e.g. 4."))
        elif self.num_attention_heads % self.num_key_value_heads:
            out.append(("num_key_value_heads", f"got {self.num_key_value_heads}; must divide num_attention_heads="
                                               f"{self.num_attention_heads}. Fix: set it equal to "
                                               "num_attention_heads."))
        return out


@dataclass
class MicroBatchSpec(_Section):
    """How a training batch is split into micro-batches for gradient accumulation."""

    max_tokens_per_mb: int = _f(8192, ge=1, help="Maximum (padded) tokens per micro-batch.")


@dataclass
class OptimizerConfig(_Section):
    """Optimizer and learning-rate schedule of the actor."""

    type: str = _f("adamw", choices=("adamw", "sgd"), help="Optimizer.")
    lr: float = _f(1e-4, gt=0.0, help="Learning rate.")
    weight_decay: float = _f(0.0, ge=0.0, help="Weight decay.")
    beta1: float = _f(0.9, ge=0.0, lt=1.0, help="Adam beta1.")
    beta2: float = _f(0.99, ge=0.0, lt=1.0, help="Adam beta2.")
    eps: float = _f(1e-8, gt=0.0, help="Adam epsilon.")
    gradient_clipping: float = _f(1.0, ge=0.0, help="Global gradient-norm clip; 0 = no clipping.")
    lr_scheduler_type: str = _f("constant", choices=("constant", "linear", "cosine"),
                                help="Learning-rate schedule after warm-up.")
    warmup_steps_proportion: float = _f(0.0, ge=0.0, le=1.0, help="Fraction of optimizer steps used for linear "
                                                                  "warm-up.")


NORM_LEVELS = ("group", "batch")


@dataclass
class NormConfig(_Section):
    """Normalisation of rewards or advantages: subtract a mean and/or divide by a std, per group or per batch."""

    mean_level: Optional[str] = _f("group", choices=NORM_LEVELS, help="Mean to subtract: group (the n_samples "
                                                                      "completions of a prompt), batch, or null "
                                                                      "(none).")
    std_level: Optional[str] = _f("group", choices=NORM_LEVELS, help="Std to divide by: group, batch, or null "
                                                                     "(none).")
    eps: float = _f(1e-4, gt=0.0, help="Added to the std before dividing.")


@dataclass
class ActorConfig(_Section):
    """The policy being trained: model, training engine, optimizer and the policy loss."""

    path: str = _f("tiny:qwen2", help="HF model directory (or hub name available offline), or tiny:qwen2 / "
                                      "tiny:llama for the embedded from-scratch model shaped by actor.tiny.")
    tiny: TinyModelConfig = _f(factory=TinyModelConfig, help="Shape of the tiny:* model.")
    backend: str = _f("torch:d1", help="Training engine and parallelism, '<engine>:d<Y>' with engine torch "
                                       "(plain/DDP) or fsdp.")
    dtype: str = _f("float32", choices=("float32", "bfloat16", "float16"), help="Parameter dtype.")
    device: str = _f("auto", choices=("auto", "cpu", "cuda"), help="auto = cuda when available, else cpu.")
    gradient_checkpointing: bool = _f(False, help="Recompute activations in the backward pass to save memory.")
    mb_spec: MicroBatchSpec = _f(factory=MicroBatchSpec, help="Micro-batching.")
    optimizer: OptimizerConfig = _f(factory=OptimizerConfig, help="Optimizer.")
    loss: str = _f("m2po", help="Policy loss, a name registered in recipe.registry (built in: m2po, vanilla, "
                                "no_trust_region).")
    loss_agg_mode: str = _f("token-mean", help="How per-token losses are aggregated (verl's modes): token-mean, "
                                               "token-sum, seq-mean-token-sum, seq-mean-token-sum-norm, "
                                               "seq-mean-token-mean.")
    m2_threshold: float = _f(0.04, ge=0.0, help="M2PO: the largest squared log-ratio tokens are masked until the "
                                                "mean M2 of the rest is below this (>= 0; 0 masks every token with "
                                                "a nonzero log-ratio).")
    m2_scope: str = _f("dp_group", choices=("local", "dp_group"),
                       help="M2PO selection scope over each optimizer mini-batch (always all of its micro-batches): "
                            "dp_group = across all data-parallel ranks, exactly Algorithm 1 on the whole "
                            "mini-batch; local = each rank's share separately.")
    eps_clip: float = _f(0.2, ge=0.0, help="PPO clip range (lower side; also the upper side unless "
                                           "eps_clip_higher is set). Used by the vanilla loss.")
    eps_clip_higher: Optional[float] = _f(None, ge=0.0, help="Upper clip range (clip-higher); null = eps_clip.")
    c_clip: Optional[float] = _f(None, gt=1.0, help="Dual-clip constant (> 1) for negative advantages; null = off.")
    ppo_n_minibatches: int = _f(1, ge=1, help="Optimizer steps per train step; must divide "
                                              "train_dataset.batch_size.")
    reward_scaling: float = _f(1.0, help="Rewards become (reward + reward_bias) * reward_scaling.")
    reward_bias: float = _f(0.0, help="See reward_scaling.")
    reward_norm: Optional[NormConfig] = _f(None, help="Reward normalisation; null = off.")
    adv_norm: Optional[NormConfig] = _f(factory=lambda: NormConfig(mean_level="group", std_level="group"),
                                        help="Advantage normalisation (GRPO: group mean and std); null = raw "
                                             "rewards as advantages.")
    behavior_logp: str = _f("rollout", choices=("rollout", "recompute"),
                            help="Behaviour log-probs: rollout = the engine's sampling log-probs; recompute = a "
                                 "training-engine forward at the generating weights (the paper authors' choice).")
    kl_coef: float = _f(0.0, help="KL penalty against a reference model. Not supported yet: must be 0.")

    def _check(self) -> List[Tuple[str, str]]:
        out = []
        if self.path.startswith("tiny:") and self.path not in ("tiny:qwen2", "tiny:llama"):
            out.append(("path", f"got {self.path!r}; the embedded models are tiny:qwen2 and tiny:llama. "
                                "Fix: set actor.path=tiny:qwen2 or an HF model directory."))
        try:
            b = parse_backend(self.backend, engines=TRAIN_ENGINES, key="backend")
        except ConfigError as e:
            out.append(("backend", e.detail))  # type: ignore[attr-defined]
        else:
            if b.engine == "torch" and (b.tp > 1 or b.pp > 1):
                out.append(("backend", f"got {self.backend!r}; the torch engine supports data parallelism only. "
                                       f"Fix: use torch:d{b.dp}."))
            elif b.engine == "fsdp" and b.pp > 1:
                out.append(("backend", f"got {self.backend!r}; fsdp does not support pipeline parallelism. "
                                       f"Fix: use fsdp:d{b.dp}" + (f"t{b.tp}" if b.tp > 1 else "") + "."))
        from recipe.registry import LOSS_AGG_MODES, is_policy_loss_registered, registered_policy_losses

        if not is_policy_loss_registered(self.loss):  # built-in names answer without importing torch
            losses = registered_policy_losses()
            out.append(("loss", f"got {self.loss!r}; expected a registered policy loss: {', '.join(losses)}"
                                f"{_did_you_mean(self.loss, losses)}. Fix: set actor.loss={losses[0]}, or "
                                "register yours with recipe.registry.register_policy_loss before load_config."))
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            out.append(("loss_agg_mode", f"got {self.loss_agg_mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}"
                                         f"{_did_you_mean(self.loss_agg_mode, LOSS_AGG_MODES)}. "
                                         "Fix: set actor.loss_agg_mode=token-mean."))
        if self.kl_coef != 0.0:
            out.append(("kl_coef", f"got {self.kl_coef!r}; a KL penalty is not supported yet. Fix: set "
                                   "actor.kl_coef=0."))
        return out


@dataclass
class SyntheticDataConfig(_Section):
    """The built-in synthetic task used when the dataset path is 'synthetic'."""

    task: str = _f("add", choices=("add", "word"), help="add = 'a+b=' arithmetic; word = short word problems.")
    max_operand: int = _f(99, ge=1, help="Largest operand.")
    train_size: int = _f(20000, ge=1, help="Examples in the train split.")
    test_size: int = _f(256, ge=1, help="Examples in the test split.")
    seed: int = _f(1234, ge=0, help="Generator seed (the splits are disjoint and reproducible).")


@dataclass
class DatasetConfig(_Section):
    """A dataset of prompts with reference answers."""

    path: str = _f("synthetic", help="synthetic, a .jsonl/.parquet file, a directory with train/test files, or a "
                                     "`datasets` name available offline (e.g. openai/gsm8k).")
    type: str = _f("rl", choices=("rl", "sft"), help="rl = prompts + answers for RL; sft = prompts + worked "
                                                     "answers.")
    split: str = _f("train", help="Split to read (train, test, ...).")
    batch_size: int = _f(32, ge=1, help="Prompts per batch.")
    shuffle: bool = _f(True, help="Shuffle every epoch.")
    max_length: Optional[int] = _f(None, ge=1, help="Drop prompts longer than this many tokens; null = keep all.")
    synthetic: SyntheticDataConfig = _f(factory=SyntheticDataConfig, help="Synthetic task (path=synthetic).")
    drop_last: bool = _f(True, help="Drop the last incomplete batch of an epoch.")

    def _check(self) -> List[Tuple[str, str]]:
        if not self.split.strip():
            return [("split", "got ''; expected a split name. Fix: set it to train or test.")]
        if not self.path.strip():
            return [("path", "got ''; expected 'synthetic', a file, a directory or a dataset name.")]
        return []


@dataclass
class SaverConfig(_Section):
    """Saving HF-format models (for use outside training; see recover for resumable checkpoints)."""

    freq_steps: Optional[int] = _f(None, ge=1, help="Save an HF-format model every N steps; null = only at the end.")
    save_final: bool = _f(True, help="Save the final model.")


@dataclass
class EvaluatorConfig(_Section):
    """Periodic evaluation on valid_dataset with eval_gconfig."""

    freq_steps: Optional[int] = _f(50, ge=1, help="Evaluate every N train steps (and at the end); null = only at "
                                                  "the end.")
    n_prompts: int = _f(256, ge=1, help="Evaluation prompts (the first N of valid_dataset).")
    at_start: bool = _f(True, help="Also evaluate before the first train step.")


@dataclass
class RecoverConfig(_Section):
    """Resumable checkpoints (model, optimizer, data position, RNG and staleness counters)."""

    mode: str = _f("disabled", choices=("disabled", "auto", "resume"),
                   help="disabled = never checkpoint/resume; auto = resume from the latest checkpoint if any; "
                        "resume = require one.")
    freq_steps: int = _f(50, ge=1, help="Checkpoint every N steps (when mode is not disabled).")
    keep_last: int = _f(2, ge=1, help="Checkpoints to keep.")


@dataclass
class StatsLoggerConfig(_Section):
    """Metrics output."""

    tensorboard: bool = _f(True, help="Write TensorBoard event files under the run directory (when tensorboard is "
                                      "installed).")
    progress_bar: bool = _f(True, help="Show a progress bar.")
    log_every: int = _f(10, ge=1, help="Print a summary line every N steps.")


@dataclass
class WarmStartConfig(_Section):
    """Supervised warm start on the generator's worked answers before RL."""

    steps: int = _f(500, ge=0, help="Supervised steps before RL; 0 disables. Only needed for from-scratch tiny "
                                    "models; set 0 for pretrained checkpoints.")
    batch_size: int = _f(64, ge=1, help="Examples per supervised step.")
    lr: float = _f(1e-3, gt=0.0, help="Supervised learning rate.")


@dataclass
class ExperimentConfig(_Section):
    """An RL experiment: GRPO-style training with a stale-rollout-aware policy loss."""

    experiment_name: str = _f("gsm8k-grpo", help="Experiment name (a directory name under cluster.fileroot).")
    trial_name: str = _f("trial0", help="Trial name (a directory name under the experiment).")
    seed: int = _f(1, ge=0, help="Global random seed.")
    total_train_epochs: int = _f(1, ge=1, help="Epochs over train_dataset.")
    total_train_steps: Optional[int] = _f(300, ge=1, help="Stop after this many train steps even if epochs remain; "
                                                          "null = run all epochs.")
    torch_threads: int = _f(2, ge=1, help="torch.set_num_threads per process. Oversubscribing cores (e.g. two "
                                          "processes x many threads on 2 cores) makes generation ~16x slower.")
    tokenizer_path: Optional[str] = _f(None, help="Tokenizer; null = actor.path.")
    cluster: ClusterConfig = _f(factory=ClusterConfig, help="Hardware and output root.")
    scheduler: SchedulerConfig = _f(factory=SchedulerConfig, help="Process launcher.")
    rollout: RolloutConfig = _f(factory=RolloutConfig, help="Generation engine and staleness control.")
    gconfig: GenerationConfig = _f(factory=GenerationConfig, help="Sampling for training rollouts.")
    eval_gconfig: GenerationConfig = _f(factory=lambda: GenerationConfig(n_samples=1, greedy=True),
                                        help="Sampling for evaluation (greedy, one sample by default).")
    actor: ActorConfig = _f(factory=ActorConfig, help="Policy, training engine and loss.")
    train_dataset: DatasetConfig = _f(factory=lambda: DatasetConfig(split="train", batch_size=32, shuffle=True),
                                      help="Training prompts.")
    valid_dataset: DatasetConfig = _f(factory=lambda: DatasetConfig(split="test", batch_size=256, shuffle=False),
                                      help="Evaluation prompts.")
    saver: SaverConfig = _f(factory=SaverConfig, help="Model export.")
    evaluator: EvaluatorConfig = _f(factory=EvaluatorConfig, help="Evaluation schedule.")
    recover: RecoverConfig = _f(factory=RecoverConfig, help="Checkpoint/resume.")
    stats_logger: StatsLoggerConfig = _f(factory=StatsLoggerConfig, help="Metrics output.")
    warm_start: WarmStartConfig = _f(factory=WarmStartConfig, help="Supervised warm start.")

    def __post_init__(self) -> None:
        if _DEFER_CHECKS.get():
            return
        # Built directly in Python (not through OmegaConf): resolve simple ${a.b} references ourselves.
        _resolve_python_interpolations(self)
        validate(self)

    @property
    def effective_tokenizer_path(self) -> str:
        """tokenizer_path, or actor.path when it is null."""
        return self.tokenizer_path if self.tokenizer_path is not None else self.actor.path

    def _check(self) -> List[Tuple[str, str]]:
        out = []
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if not value.strip() or value in (".", "..") or "/" in value or "\\" in value:
                out.append((name, f"got {value!r}; expected a non-empty directory name without '/'. "
                                  f"Fix: set {name}=my-run."))
        return out


# --------------------------------------------------------------------------------------------------------------------
# Value checks
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _type_hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) in (list, List):
        (arg,) = typing.get_args(inner) or (Any,)
        name = f"a list of {getattr(arg, '__name__', str(arg))}"
    elif dataclasses.is_dataclass(inner):
        name = f"a {inner.__name__} mapping"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _check_value(key: str, value: Any, tp: Any, metadata: Any) -> Optional[str]:
    """A problem message for one field value, or None."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        return f"got null; expected {_type_name(tp)}. Fix: set {key} to a value (null is not allowed here)."
    if _is_interpolation(value) and inner is not str:
        return None  # unresolved (direct Python construction); ExperimentConfig resolves and re-checks
    ok = True
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            return f"got {value!r}; expected a finite number. Fix: set {key} to a finite value."
    elif inner is str:
        ok = isinstance(value, str)
    elif typing.get_origin(inner) in (list, List):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif dataclasses.is_dataclass(inner):
        ok = isinstance(value, inner)
    if not ok:
        return f"got {value!r} ({type(value).__name__}); expected {_type_name(tp)}."
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        allowed = ", ".join(choices) + (", null" if optional else "")
        return (f"got {value!r}; expected one of {allowed}{_did_you_mean(str(value), choices)}. "
                f"Fix: set {key}={choices[0]}.")
    for name, op, words in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                            ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = metadata.get(name)
        if bound is not None and not op(value, bound):
            return f"got {value!r}; expected {words} {bound}. Fix: set {key} to a value {words} {bound}."
    return None


def _did_you_mean(word: str, candidates: Any) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _format_problems(problems: List[Tuple[str, str]]) -> str:
    if len(problems) == 1:
        key, msg = problems[0]
        return f"invalid config: {key}: {msg}"
    lines = [f"invalid config ({len(problems)} problems):"]
    lines += [f"  - {msg}" if msg.startswith("unknown config key") else f"  - {key}: {msg}" for key, msg in problems]
    return "\n".join(lines)


def _walk_sections(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted prefix, section) for every dataclass section in the tree, parents first."""
    yield prefix, node
    for f in dataclasses.fields(node):
        child = getattr(node, f.name)
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            yield from _walk_sections(child, f"{prefix}.{f.name}" if prefix else f.name)


def _resolve_python_interpolations(cfg: Any) -> None:
    """Replace ``"${a.b}"`` field values (dataclass defaults) by the referenced values, for direct construction."""
    for _, section in _walk_sections(cfg):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            m = re.fullmatch(r"\$\{([A-Za-z_][\w.]*)\}", value) if isinstance(value, str) else None
            if m is None or _unwrap_optional(_type_hints(type(section))[f.name])[0] is str:
                continue
            target: Any = cfg
            try:
                for part in m.group(1).split("."):
                    target = getattr(target, part)
            except AttributeError:
                continue  # validate() reports the unresolved value
            setattr(section, f.name, target)


def validate(cfg: "ExperimentConfig") -> "ExperimentConfig":
    """Check every section and the cross-field rules; raise one :class:`ConfigError` listing every problem.

    Issues :class:`ConfigWarning` for legal but suspicious settings. Returns ``cfg`` for chaining.
    """
    problems: List[Tuple[str, str]] = []
    for prefix, section in _walk_sections(cfg):
        problems += section._problems(prefix)
    if not problems:  # cross-field rules assume every section is well-formed
        problems = _cross_field_problems(cfg)
    if problems:
        raise ConfigError(_format_problems(problems), [k for k, _ in problems])
    for msg in _cross_field_warnings(cfg):
        warnings.warn(msg, ConfigWarning, stacklevel=2)
    return cfg


def is_async(cfg: "ExperimentConfig") -> bool:
    """Whether the run uses separate rollout and train workers (see rollout.mode)."""
    ro = cfg.rollout
    if ro.mode != "auto":
        return ro.mode == "async"
    if ro.fixed_staleness > 0:
        return False
    rb = parse_backend(ro.backend, engines=ROLLOUT_ENGINES, key="rollout.backend")
    ab = parse_backend(cfg.actor.backend, engines=TRAIN_ENGINES, key="actor.backend")
    return ro.max_head_offpolicyness > 0 or rb.dp > 1 or ab.dp > 1


def _cross_field_problems(cfg: ExperimentConfig) -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = []
    ro, actor = cfg.rollout, cfg.actor
    if ro.fixed_staleness > 0 and ro.max_head_offpolicyness > 0:
        out.append(("rollout.fixed_staleness",
                    f"got {ro.fixed_staleness} together with rollout.max_head_offpolicyness="
                    f"{ro.max_head_offpolicyness}; these are two different staleness modes (a fixed FIFO lag vs. "
                    "admission control), pick one. Fix: set rollout.max_head_offpolicyness=0 or "
                    "rollout.fixed_staleness=0."))
    if ro.fixed_staleness > 0 and ro.mode == "async":
        out.append(("rollout.mode",
                    f"got 'async' with rollout.fixed_staleness={ro.fixed_staleness}; the fixed-staleness FIFO runs "
                    "in the synchronous loop. Fix: set rollout.mode=sync (or auto), or use "
                    "rollout.max_head_offpolicyness for asynchronous staleness."))
    n_mb = actor.ppo_n_minibatches
    for key, size in (("train_dataset.batch_size", cfg.train_dataset.batch_size),
                      ("rollout.consumer_batch_size", ro.consumer_batch_size)):
        if isinstance(size, int) and size % n_mb:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            out.append(("actor.ppo_n_minibatches",
                        f"got {n_mb}; it must divide {key}={size} (prompts are split evenly into mini-batches). "
                        f"Fix: set actor.ppo_n_minibatches to one of {divisors[:8]} or change {key}."))
            break
    for name in ("reward_norm", "adv_norm"):
        norm = getattr(actor, name)
        if norm is not None and "group" in (norm.mean_level, norm.std_level) and cfg.gconfig.n_samples < 2:
            out.append(("gconfig.n_samples",
                        f"got {cfg.gconfig.n_samples}; actor.{name} normalises per group, which needs >= 2 "
                        "completions per prompt (a group of 1 has zero advantage). Fix: set gconfig.n_samples=4, "
                        f"or actor.{name}.mean_level=batch actor.{name}.std_level=batch."))
            break
    if actor.path.startswith("tiny:"):
        limit = actor.tiny.max_position_embeddings
        for gkey in ("gconfig", "eval_gconfig"):
            new = getattr(cfg, gkey).max_new_tokens
            if new >= limit:
                out.append((f"{gkey}.max_new_tokens",
                            f"got {new}; the tiny model holds only actor.tiny.max_position_embeddings={limit} "
                            "tokens including the prompt. Fix: lower it or raise "
                            "actor.tiny.max_position_embeddings."))
    rb = parse_backend(ro.backend, engines=ROLLOUT_ENGINES, key="rollout.backend")
    ab = parse_backend(actor.backend, engines=TRAIN_ENGINES, key="actor.backend")
    total = cfg.cluster.n_nodes * cfg.cluster.n_gpus_per_node
    if rb.engine in _GPU_ROLLOUT_ENGINES and total == 0:
        out.append(("rollout.backend",
                    f"got {ro.backend!r}; {rb.engine} needs GPUs but cluster.n_gpus_per_node=0. Fix: set "
                    "cluster.n_gpus_per_node=<GPUs per node>, or rollout.backend=hf:d1 for CPU."))
    elif total > 0:
        need_rollout = rb.world_size if rb.engine in _GPU_ROLLOUT_ENGINES else 0
        need_actor = ab.world_size if actor.device != "cpu" else 0
        if need_rollout + need_actor > total:
            out.append(("cluster.n_gpus_per_node",
                        f"rollout.backend={ro.backend!r} ({need_rollout} GPUs) + actor.backend={actor.backend!r} "
                        f"({need_actor} GPUs) need {need_rollout + need_actor} GPUs, but cluster has "
                        f"n_nodes * n_gpus_per_node = {total}. Fix: shrink the backends or raise cluster.n_nodes / "
                        "cluster.n_gpus_per_node."))
    if actor.device == "cpu" and actor.dtype == "float16":
        out.append(("actor.dtype", "got 'float16' with actor.device=cpu; CPU training in float16 is not supported. "
                                   "Fix: set actor.dtype=float32 (or bfloat16)."))
    return out


def _cross_field_warnings(cfg: ExperimentConfig) -> List[str]:
    out = []
    g = cfg.gconfig
    if g.top_k != 0:
        out.append(f"gconfig.top_k={g.top_k}: top-k sampling makes the behaviour log-probs differ from the policy's "
                   "softmax, so importance ratios and M2 are biased. Set gconfig.top_k=0 unless intended.")
    if g.greedy:
        out.append("gconfig.greedy=true: every completion of a group is identical, so group-normalised advantages "
                   "are zero. Set gconfig.greedy=false for training (eval_gconfig is separate).")
    return out


# --------------------------------------------------------------------------------------------------------------------
# Schema introspection
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _schema(config_cls: type) -> Dict[str, Tuple[Any, dataclasses.Field]]:
    out: Dict[str, Tuple[Any, dataclasses.Field]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = _type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            out[key] = (hints[f.name], f)
            inner, _ = _unwrap_optional(hints[f.name])
            if dataclasses.is_dataclass(inner):
                walk(inner, key)

    walk(config_cls, "")
    return out


def schema_keys(config_cls: type = ExperimentConfig) -> List[str]:
    """Every dotted key of the schema (sections included), in declaration order."""
    return list(_schema(config_cls))


def _suggest(key: str, config_cls: type) -> List[str]:
    """Did-you-mean candidates for an unknown dotted key (at most 2), best first.

    A close key in the same section wins; then the same leaf name in another section (``actor.max_head_offpolicyness``
    -> ``rollout.max_head_offpolicyness``); then close keys or close leaf names anywhere.
    """
    schema = _schema(config_cls)
    keys = [k for k in schema if not k.startswith(key + ".")]
    parent, _, leaf = key.rpartition(".")

    def split(k: str) -> Tuple[str, str]:
        p, _, l = k.rpartition(".")
        return p, l

    siblings = {split(k)[1]: k for k in keys if split(k)[0] == parent}
    ranked = [k for n, k in siblings.items() if len(leaf) >= 3 and (n.startswith(leaf) or leaf.startswith(n))]
    ranked += [siblings[n] for n in difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.7)]
    ranked += [k for k in keys if split(k)[1] == leaf and split(k)[0] != parent]
    ranked += difflib.get_close_matches(key, keys, n=2, cutoff=0.8)
    by_leaf: Dict[str, List[str]] = {}
    for k in keys:
        by_leaf.setdefault(split(k)[1], []).append(k)
    for name in difflib.get_close_matches(leaf, list(by_leaf), n=2, cutoff=0.8):
        ranked += by_leaf[name]
    out: List[str] = []
    for k in ranked:
        if k not in out and k != parent:
            out.append(k)
    return out[:2]


# AReaL spellings that have a different name here.
_RENAMED = {
    "recompute_logprob": "actor.behavior_logp=recompute",
    "recompute_logprobs": "actor.behavior_logp=recompute",
    "kl_ctl": "actor.kl_coef",
    "allocation_mode": "rollout.backend and actor.backend (e.g. rollout.backend=sglang:d2 actor.backend=fsdp:d1)",
    "clip_ratio": "actor.eps_clip",
    "clip_ratio_c": "actor.c_clip",
    "loss_mode": "actor.loss",
}


def _unknown_key_message(key: str, config_cls: type, source: str) -> str:
    msg = f"unknown config key {key!r} ({source})"
    suggestions = _suggest(key, config_cls)
    renamed = _RENAMED.get(key.rpartition(".")[2])
    if renamed and config_cls is ExperimentConfig:
        msg += f"; this setting is called {renamed} here."
    elif suggestions:
        msg += "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
    else:
        msg += "."
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    schema = _schema(config_cls)
    if parent in schema or parent == "":
        siblings = [k.rsplit(".", 1)[-1] for k in schema if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
        where = f"'{parent}'" if parent else "the top level"
        msg += f" Valid keys in {where}: {', '.join(siblings)}."
    msg += " Run with --help to list every key."
    return msg


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------

_FLAGS = {"--dry-run": "dry_run", "--plot": "plot", "--help": "help", "-h": "help"}


def parse_args(argv: Optional[List[str]] = None) -> Tuple[Optional[str], List[str], Dict[str, bool]]:
    """Split ``argv`` into (config_path, overrides, flags).

    Recognises ``--config FILE`` / ``--config=FILE``, ``--dry-run``, ``--plot``, ``-h``/``--help``; every other item
    must be a ``key=value`` override (``+key=value`` is normalised to ``key=value``). A leading ``*.py`` item (the
    script itself) is dropped. ``flags`` has the keys ``dry_run``, ``plot`` and ``help``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0].endswith(".py") and "=" not in args[0]:
        args = args[1:]
    config_path: Optional[str] = None
    overrides: List[str] = []
    flags = {"dry_run": False, "plot": False, "help": False}
    i = 0
    while i < len(args):
        item = args[i]
        if item == "--config" or item.startswith("--config="):
            if item == "--config":
                if i + 1 >= len(args) or args[i + 1].startswith("-"):
                    raise ConfigError("--config needs a file: --config path/to/experiment.yaml")
                value = args[i + 1]
                i += 1
            else:
                value = item.split("=", 1)[1]
            if config_path is not None:
                raise ConfigError(f"--config given twice ({config_path!r} and {value!r}); pass one file and put "
                                  "the differences in key=value overrides")
            if not value:
                raise ConfigError("--config needs a file: --config path/to/experiment.yaml")
            config_path = value
        elif item in _FLAGS:
            flags[_FLAGS[item]] = True
        elif item.startswith("-") and not item.startswith("--") and "=" not in item and item != "-h":
            raise ConfigError(f"unknown option {item!r}; options are --config FILE, --dry-run, --plot, --help")
        elif item.startswith("--"):
            name = item.split("=", 1)[0]
            hint = _did_you_mean(name, list(_FLAGS) + ["--config"])
            extra = f" Overrides are written without dashes: {item[2:]}" if "=" in item else ""
            raise ConfigError(f"unknown option {name!r}{hint}; options are --config FILE, --dry-run, --plot, "
                              f"--help.{extra}")
        elif item.startswith("~"):
            raise ConfigError(f"{item!r}: deleting keys is not supported; every key has a default. Set "
                              f"{item[1:].split('=')[0]}=<value> instead (optional keys accept null).")
        else:
            override = item[1:] if item.startswith("+") else item
            key, eq, _ = override.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"cannot parse argument {item!r}: expected key=value (e.g. actor.optimizer.lr=1e-5)"
                                  " or one of --config FILE, --dry-run, --plot, --help")
            overrides.append(override)
        i += 1
    return config_path, overrides, flags


def _override_value(raw: str, tp: Any) -> Any:
    """Parse an override's value: strings stay verbatim (YAML would turn 1:00:00 into 3600), the rest via YAML."""
    inner, optional = _unwrap_optional(tp)
    if inner is str:
        if optional and raw in ("null", "~", "None"):
            return None
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            return raw[1:-1]
        return raw
    if raw == "None" and optional:
        return None
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
    return parsed


def _nest(key: str, value: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node[p] = {}
        node = node[p]
    node[parts[-1]] = value
    return out


def _yaml_keys(data: Any, config_cls: type, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) for every leaf of a YAML mapping, descending only into schema sections."""
    schema = _schema(config_cls)
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        yield key, v
        if key in schema and isinstance(v, dict) and dataclasses.is_dataclass(_unwrap_optional(schema[key][0])[0]):
            yield from _yaml_keys(v, config_cls, key)


def _oc_error(e: OmegaConfBaseException, config_cls: type, source: str,
              value: Any = dataclasses.MISSING) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    schema = _schema(config_cls)
    expected = f"; expected {_type_name(schema[key][0])}" if key in schema else ""
    shown = f"={value!r}" if value is not dataclasses.MISSING else ""
    m = re.search(r"Interpolation key '([^']+)' not found", first)
    hint = ""
    if m:
        close = _suggest(m.group(1), config_cls)
        hint = f" (did you mean ${{{close[0]}}}?)" if close else ""
    fix = f" Fix: give {key} a value of type {_type_name(schema[key][0])}." if key in schema else ""
    return ConfigError(f"invalid config: {key or '<root>'}{shown}: {first}{hint}{expected} ({source}).{fix}",
                       [key] if key else [])


def _merge_yaml(base: DictConfig, path: Union[str, os.PathLike], config_cls: type) -> DictConfig:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file not found: {str(path)!r} (resolved to {p.resolve()})")
    try:
        loaded = OmegaConf.load(p)
    except Exception as e:  # yaml.YAMLError and friends
        raise ConfigError(f"cannot parse YAML config {str(p)!r}: {e}") from None
    if loaded is None or (isinstance(loaded, DictConfig) and len(loaded) == 0):
        return base
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"YAML config {str(p)!r} must be a mapping of keys to values, got a "
                          f"{type(loaded).__name__}")
    data = OmegaConf.to_container(loaded, resolve=False)
    schema = _schema(config_cls)
    problems = []
    for key, value in _yaml_keys(data, config_cls):
        if key not in schema:
            problems.append((key, _unknown_key_message(key, config_cls, f"in {p}")))
        elif key == "scheduler.slurm.time" and isinstance(value, int) and not isinstance(value, bool):
            problems.append((key, f"got the integer {value}: YAML reads an unquoted H:MM:SS as a base-60 number. "
                                  f"Fix: quote it in {p}, e.g. time: \"01:00:00\"."))
    if problems:
        if len(problems) == 1:
            key, msg = problems[0]
            raise ConfigError(msg if msg.startswith("unknown") else f"invalid config: {key}: {msg}", [key])
        raise ConfigError(_format_problems(problems), [k for k, _ in problems])
    try:
        return OmegaConf.merge(base, loaded)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "")
        value = OmegaConf.select(loaded, key, default=dataclasses.MISSING) if key else dataclasses.MISSING
        raise _oc_error(e, config_cls, f"from {p}", value) from None


def _merge_overrides(base: DictConfig, overrides: List[str], config_cls: type) -> DictConfig:
    schema = _schema(config_cls)
    unknown = []
    parsed = []
    for item in overrides:
        item = item[1:] if item.startswith("+") else item
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(f"cannot parse override {item!r}: expected key=value")
        if key not in schema:
            unknown.append((key, _unknown_key_message(key, config_cls, f"override {item!r}")))
            continue
        parsed.append((item, key, raw))
    if unknown:
        if len(unknown) == 1:
            raise ConfigError(unknown[0][1], [unknown[0][0]])
        raise ConfigError(_format_problems(unknown), [k for k, _ in unknown])
    values = []
    for item, key, raw in parsed:
        try:
            values.append(_override_value(raw, schema[key][0]))
        except Exception as e:  # noqa: BLE001 - YAML syntax errors in the value
            raise ConfigError(f"invalid config: {key}: cannot parse value {raw!r} (override {item!r}): {e}",
                              [key]) from None
    if not parsed:
        return base
    nests = [_nest(key, value) for (_, key, _), value in zip(parsed, values)]
    try:
        return OmegaConf.merge(base, *nests)  # one copy of the base; applied left to right
    except OmegaConfBaseException:
        pass
    cfg = base  # find the offending override
    for (item, key, _), value, nest in zip(parsed, values, nests):
        try:
            cfg = OmegaConf.merge(cfg, nest)
        except OmegaConfBaseException as e:
            if not getattr(e, "full_key", None):
                e.full_key = key  # type: ignore[attr-defined]
            raise _oc_error(e, config_cls, f"override {item!r}", value) from None
    return cfg


def _build(base: DictConfig, config_path: Optional[Union[str, os.PathLike]], overrides: List[str],
           config_cls: type) -> Any:
    with _deferred_checks():
        if config_path is not None:
            base = _merge_yaml(base, config_path, config_cls)
        base = _merge_overrides(base, overrides, config_cls)
        try:
            cfg = OmegaConf.to_object(base)
        except OmegaConfBaseException as e:
            raise _oc_error(e, config_cls, "while resolving the config") from None
    if isinstance(cfg, ExperimentConfig):
        validate(cfg)
    else:  # another schema: per-section checks only
        problems = [p for prefix, s in _walk_sections(cfg) if isinstance(s, _Section) for p in s._problems(prefix)]
        if problems:
            raise ConfigError(_format_problems(problems), [k for k, _ in problems])
    return cfg


def load_config(argv: Optional[List[str]] = None, *, config_cls: type = ExperimentConfig) -> Any:
    """Build and validate the config from ``argv`` (default ``sys.argv[1:]``).

    ``[--config FILE.yaml] [key=value | +key=value ...] [--dry-run] [--plot] [-h|--help]``. Without ``--config`` the
    schema defaults are used. ``--help`` prints every key with its help and default, then exits 0. ``--dry-run`` and
    ``--plot`` are accepted and ignored here (read them with :func:`parse_args`). Raises :class:`ConfigError`.
    """
    config_path, overrides, flags = parse_args(argv)
    if flags["help"]:
        print(format_help(config_cls))
        raise SystemExit(0)
    with _deferred_checks():
        base = OmegaConf.structured(config_cls)
    return _build(base, config_path, overrides, config_cls)


def apply_overrides(cfg_or_yaml_path: Union[Any, str, os.PathLike], overrides: List[str], *,
                    config_cls: type = ExperimentConfig) -> Any:
    """A new validated config: ``cfg_or_yaml_path`` (a config object or a YAML file) with ``overrides`` applied.

    The input object is not modified. Used for sweeps: ``apply_overrides(base_cfg, ["actor.loss=vanilla"])``.
    """
    overrides = [o[1:] if o.startswith("+") else o for o in overrides]
    if dataclasses.is_dataclass(cfg_or_yaml_path) and not isinstance(cfg_or_yaml_path, type):
        config_cls = type(cfg_or_yaml_path)
        with _deferred_checks():
            base = OmegaConf.merge(OmegaConf.structured(config_cls), OmegaConf.structured(cfg_or_yaml_path))
        return _build(base, None, overrides, config_cls)
    with _deferred_checks():
        base = OmegaConf.structured(config_cls)
    return _build(base, cfg_or_yaml_path, overrides, config_cls)


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (loadable again with ``--config``)."""
    with _deferred_checks():
        node = OmegaConf.structured(cfg)
    return OmegaConf.to_yaml(node, resolve=True)


def save_resolved_config(cfg: Any, path: Union[str, os.PathLike]) -> Path:
    """Write :func:`config_to_yaml` to ``path`` atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = config_to_yaml(cfg)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(str(path.parent), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def run_dir(cfg: ExperimentConfig) -> Path:
    """``{cluster.fileroot}/{experiment_name}/{trial_name}``."""
    return Path(cfg.cluster.fileroot).expanduser() / cfg.experiment_name / cfg.trial_name


def _fmt_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def format_help(config_cls: type = ExperimentConfig) -> str:
    """Usage, options, and every config key with its type, default, choices and help, grouped by section."""
    import textwrap

    lines = [
        "usage: python <script>.py [--config FILE.yaml] [key=value ...] [--dry-run] [--plot] [-h]",
        "",
        "options:",
        "  --config FILE   YAML file merged over the defaults below (optional).",
        "  --dry-run       Load and validate the config, print it, and exit without training.",
        "  --plot          Plot the run's metrics when it finishes.",
        "  -h, --help      Show this help and exit.",
        "",
        "Overrides: dotted key=value pairs applied after the YAML file (+key=value means the same). Values are",
        "YAML (null, true, 1e-4, [a,b]); ${other.key} interpolates. Unknown keys are errors.",
    ]
    with _deferred_checks():
        defaults = OmegaConf.to_container(OmegaConf.structured(config_cls), resolve=False)

    def default_of(key: str, f: dataclasses.Field) -> str:
        node: Any = defaults
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                node = dataclasses.MISSING
                break
            node = node[part]
        if node is dataclasses.MISSING:  # inside an optional section that defaults to null
            if f.default is not dataclasses.MISSING:
                node = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                with _deferred_checks():
                    node = f.default_factory()  # type: ignore[misc]
            else:
                return "(required)"
        return _fmt_value(node)

    def wrap(text: str) -> List[str]:
        return [f"      {chunk}" for chunk in textwrap.wrap(text, width=100)]

    def section(cls: type, prefix: str, parent: Optional[dataclasses.Field], optional: bool) -> None:
        lines.append("")
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        title = f"[{prefix or 'top level'}] {cls.__name__}" + (f": {doc}" if doc else "")
        lines.append(title)
        if parent is not None and optional:
            state = "null (off)" if parent.default is None else "set"
            lines.extend(wrap(f"{parent.metadata.get('help', '')} Optional section, default {state}; "
                          f"{prefix}=null turns it off, setting any {prefix}.* key turns it on."))
        hints = _type_hints(cls)
        nested = []
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            inner, opt = _unwrap_optional(hints[f.name])
            if dataclasses.is_dataclass(inner):
                nested.append((inner, key, f, opt))
                continue
            extra = "  {" + "|".join(f.metadata["choices"]) + "}" if "choices" in f.metadata else ""
            lines.append(f"  {key}: {_type_name(hints[f.name])} = {default_of(key, f)}{extra}")
            lines.extend(wrap(f.metadata.get("help", "")))
        for inner, key, f, opt in nested:
            section(inner, key, f, opt)

    section(config_cls, "", None, False)
    return "\n".join(lines)
