"""Settings of the recipe losses inside ms-swift's GRPO: names, where their keys come from, what is refused.

ms-swift parses its command line into a fixed dataclass and refuses unknown flags *before* it imports the
``--external_plugins`` files, so a plugin cannot add ``--m2_threshold``. The loss keys therefore travel as
environment variables, which ms-swift's launcher (torchrun under ``NPROC_PER_NODE``) hands to every rank unchanged.
Every variable with the ``STALERL_`` loss prefixes is checked once, when the plugin is imported (before ms-swift
loads the model): an unknown name, an unparsable value or an out-of-range one fails with one line naming it.

The loss types and variables are generated from the losses' declarations (``recipe.registry.usable_declarations``,
plugins included; a loss whose ms-swift name is one of ms-swift's own, :data:`SWIFT_LOSS_TYPES`, is refused alone):
``--loss_type`` is the loss's name (``fipo_ref`` for the reference FIPO: ms-swift has its own ``fipo``), each
parameter's variable is ``STALERL_`` + its name in upper case, checked by the Param itself and the declaration's
rules. The PPO clip of a loss that uses one (``fipo_ref``, ``vanilla``) is ms-swift's own
``--epsilon`` / ``--epsilon_high``.

Torch-free and ms-swift-free at import (the losses' own rules, which import torch, are imported when a config is
checked): the CLI helper imports it without either.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

FRAMEWORK = "swift"
#: ms-swift's own GRPO ``--loss_type`` values (4.6: ``GRPOTrainer._compute_loss_and_metrics``), pinned; the swift
#: lane checks them against the installed ms-swift. A registered loss whose ms-swift name is one of them is refused
#: in ms-swift alone, one logged line naming it and the fix (``recipe.registry.usable_declarations``).
SWIFT_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "real", "fipo")


def _declarations() -> "dict[str, Any]":
    """{registry name: declaration} of every loss ms-swift can take (the clash check every adapter shares)."""
    from recipe.registry import usable_declarations

    return usable_declarations(FRAMEWORK, own_losses=SWIFT_LOSS_TYPES)


def swift_loss_name(declaration: Any) -> str:
    """A registry loss's ``--loss_type`` in ms-swift: its declared swift name where ms-swift already uses the name for
    a loss of its own (FIPO: ms-swift's ``fipo`` stays ms-swift's, the registry's is ``fipo_ref``)."""
    return declaration.name_in(FRAMEWORK)


def env_name(param: Any) -> str:
    """The environment variable of a loss parameter: ``STALERL_`` + its ms-swift name, upper case."""
    return "STALERL_" + param.name_in(FRAMEWORK).upper()


@dataclass(frozen=True)
class EnvKey:
    env: str
    key: str  # the registry config key (stalerl's actor.* name)
    kind: str  # "float", "bool" or "str"
    default: Any
    param: Any = None  # the loss's recipe.declaration.Param (None: an adapter setting)
    meaning: str = ""


def _env_keys() -> "dict[str, tuple[EnvKey, ...]]":
    """{ms-swift loss_type: its EnvKeys}, generated from every registered loss's declaration (plugins included); a
    step-scope parameter is the adapter's business (it always plans the whole step over every process)."""
    out = {}
    for decl in _declarations().values():
        out[swift_loss_name(decl)] = tuple(
            EnvKey(env_name(p), p.name, {bool: "bool", str: "str"}.get(p.kind, "float"), p.default_in(FRAMEWORK), p,
                   p.help) for p in decl.params if not decl.is_step_scope(p))
    return out


def swift_loss_types() -> "dict[str, str]":
    """{ms-swift ``--loss_type``: ``recipe.registry`` name} of every registered loss (plugins included)."""
    return {swift_loss_name(decl): decl.name for decl in _declarations().values()}


#: Opt-in (true/false, default false): when vLLM's rollout log-probs are missing for part of an optimizer step, use
#: ms-swift's ``old_per_token_logps`` as the behaviour policy for the whole step (all micro-batches, all ranks) instead
#: of refusing the step; every step then logs ``<loss>/behaviour_old_logps_fallback`` (1 when it fell back, else 0).
OLD_LOGPS_FALLBACK_ENV = "STALERL_SWIFT_OLD_LOGPS_FALLBACK"
ADAPTER_ENV_KEYS = (
    EnvKey(OLD_LOGPS_FALLBACK_ENV, "old_logps_fallback", "bool", False, None,
           "fall back to ms-swift's old_per_token_logps for a step whose rollout log-probs are incomplete"),
)


def _all_env_names() -> tuple[str, ...]:
    return tuple(k.env for keys in _env_keys().values() for k in keys) + tuple(k.env for k in ADAPTER_ENV_KEYS)


def _env_prefixes() -> tuple[str, ...]:
    """Variables with these prefixes are this adapter's: an unknown one (a typo) is refused. ``STALERL_`` + the first
    word of every loss parameter (``STALERL_M2``, ``STALERL_FIPO``, ...), and ``STALERL_SWIFT_``."""
    words = {k.env.split("_")[1] for keys in _env_keys().values() for k in keys}
    return tuple(sorted(f"STALERL_{w}" for w in words)) + ("STALERL_SWIFT_",)


def __getattr__(name: str) -> Any:  # generated when asked: plugin losses registered late are included
    lazy = {"ENV_KEYS": _env_keys, "LOSS_TYPES": swift_loss_types, "ALL_ENV_NAMES": _all_env_names,
            "ENV_PREFIXES": _env_prefixes}
    if name in lazy:
        return lazy[name]()
    raise AttributeError(f"module 'recipe.swift.config' has no attribute {name!r}")


def namesake_flags(loss_type: str) -> "tuple[tuple[str, Any, str], ...]":
    """(flag, ms-swift default, the variable to use instead) of each ms-swift flag that configures ms-swift's *own*
    loss of the same name as ``loss_type``'s (``LossDeclaration.namesake_flags``: FIPO declares ms-swift's ``fipo_*``
    flags and ``--delta``); with the registry's loss a non-default value would be silently ignored, so it is refused."""
    decl = _declarations()[swift_loss_types()[loss_type]]
    return tuple((f.flag, f.default, env_name(decl.param(f.param))) for f in decl.namesake_flags.get(FRAMEWORK, ()))

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse(spec: EnvKey, raw: str) -> Any:
    """The variable's value: a boolean from its text, else the Param's own check (numbers, bounds, choices)."""
    text = raw.strip()
    if spec.kind == "bool":
        if text.lower() in _TRUE:
            value: Any = True
        elif text.lower() in _FALSE:
            value = False
        else:
            raise ValueError(f"{spec.env}={raw!r} is not a boolean; expected true or false ({spec.meaning}). "
                             f"Fix: export {spec.env}={'true' if spec.default else 'false'}")
        return value
    if spec.param is None:
        return text
    value = text
    if spec.kind == "float":  # the environment holds text: a number is parsed here, then checked by the Param
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{spec.env}={raw!r} is not a number; expected a float ({spec.meaning}, default "
                             f"{spec.default}). Fix: export {spec.env}={spec.default}") from None
    try:
        return spec.param.check(value, spec.env, framework=FRAMEWORK)
    except ValueError as exc:
        raise ValueError(str(exc).replace(f"Fix: set {spec.env}=", f"Fix: export {spec.env}=")) from None


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a ``STALERL_M2*`` / ``STALERL_FIPO_*`` variable this adapter does not know (a typo would be ignored)."""
    environ = os.environ if environ is None else environ
    known, prefixes = _all_env_names(), _env_prefixes()
    for name in sorted(environ):
        if name.startswith(prefixes) and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ValueError(f"unknown loss setting {name} in the environment;{hint} known: "
                             f"{', '.join(known)}. Fix: rename or unset it")


def loss_config(loss_type: str, *, epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
                environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The registry config of ``loss_type`` (an ms-swift ``--loss_type`` of this adapter) from the environment,
    checked by the loss's Params and its declaration's rules; the PPO clip from ``--epsilon`` / ``--epsilon_high``
    for a loss that uses it."""
    decls = {swift_loss_name(d): d for d in _declarations().values()}
    if loss_type not in decls:
        raise ValueError(f"loss_type {loss_type!r} is not one of this adapter's: {', '.join(decls)}")
    decl = decls[loss_type]
    environ = os.environ if environ is None else environ
    check_environment(environ)
    config: dict[str, Any] = {}
    specs = _env_keys()[loss_type]
    for spec in specs:
        raw = environ.get(spec.env)
        config[spec.key] = spec.default if raw is None or raw.strip() == "" else _parse(spec, raw)
    low = float(epsilon_low)
    clip = (low, float(low if epsilon_high is None else epsilon_high))
    problems = decl.problems(config, clip)
    if problems:
        env = {spec.key: spec.env for spec in specs}
        message = "; ".join(f"{env.get(key, key)} {msg}" for key, msg in problems)
        raise ValueError(f"{loss_type}: {message} (settings come from {', '.join(env.values())}; the PPO clip from "
                         "--epsilon/--epsilon_high)")
    if decl.uses_ppo_clip:
        config["clip_ratio_low"], config["clip_ratio_high"] = clip
    return config


def old_logps_fallback(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the user opted in to the old-log-prob fallback (:data:`OLD_LOGPS_FALLBACK_ENV`)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(OLD_LOGPS_FALLBACK_ENV)
    return False if raw is None or raw.strip() == "" else bool(_parse(ADAPTER_ENV_KEYS[0], raw))


#: Where the behaviour log-probs of an optimizer step come from (one source for the whole step, every rank).
ROLLOUT, OLD, CURRENT = "rollout", "old", "current"


def behaviour_source(loss_type: str, *, every_rollout: bool, any_rollout: bool, every_old: bool, use_vllm: bool,
                     async_generate: bool, allow_old_fallback: bool) -> tuple[str, bool]:
    """(the step's behaviour source, whether it is the opt-in fallback), decided from flags already reduced over the
    step's micro-batches and every rank; refuses with one line what would not be exact.

    - vLLM's rollout log-probs for every micro-batch on every rank: those (the sampler's policy, staleness included).
    - ``--async_generate`` without them: refused, opt-in or not: ms-swift's ``old_per_token_logps`` are recomputed
      with the current weights when the batch is built, so the data's staleness would be invisible to the loss.
    - HF generation (no vLLM, no rollout log-probs anywhere): ``old_per_token_logps`` (the generating policy, computed
      right after generation by the same model), else on-policy.
    - vLLM (or any rollout log-probs) but not for the whole step: refused, or with the opt-in, ``old_per_token_logps``
      for the whole step (the training engine's log-probs of the generating weights), logged every step.
    """
    if every_rollout:
        return ROLLOUT, False
    where = f"--loss_type {loss_type}"
    if async_generate:
        raise RuntimeError(f"{where} with --async_generate: vLLM's rollout log-probs are missing for part of this "
                           "optimizer step, and ms-swift's old_per_token_logps are recomputed with the current weights, "
                           "so the data's staleness would be invisible to the loss. Fix: have vLLM return log-probs "
                           "for every completion (a single-turn rollout whose log-prob count matches the completion), "
                           "or --async_generate false")
    if not use_vllm and not any_rollout:
        return (OLD if every_old else CURRENT), False
    if not allow_old_fallback:
        raise RuntimeError(f"{where}: vLLM's rollout log-probs are missing for part of this optimizer step (ms-swift "
                           "drops them for a completion whose log-prob count does not match); one step's loss must use "
                           "one behaviour policy on every micro-batch and rank. Fix: make vLLM return log-probs for "
                           f"every completion, or export {OLD_LOGPS_FALLBACK_ENV}=true to use ms-swift's "
                           "old_per_token_logps for such steps (logged as <loss>/behaviour_old_logps_fallback)")
    if not every_old:
        raise RuntimeError(f"{where}: neither rollout log-probs nor ms-swift's old_per_token_logps cover this whole "
                           "optimizer step, so it has no single behaviour policy. Fix: make vLLM return log-probs for "
                           "every completion")
    return OLD, True


def check_swift_args(args: Any) -> None:
    """Refuse, with one line naming the flag, the ms-swift settings the recipe losses do not implement.

    ``args`` is ms-swift's ``RLHFArguments`` or the trainer's ``GRPOConfig`` (read with ``getattr``, so a field a
    given ms-swift version lacks counts as unset). Does nothing for ms-swift's own loss types.
    """
    loss_type = getattr(args, "loss_type", None)
    names = swift_loss_types()
    if loss_type not in names:
        return
    from recipe.versions import check_framework_version

    check_framework_version("ms-swift", where="recipe.swift")

    def refuse(flag: str, value: Any, why: str, fix: str) -> None:
        raise ValueError(f"--loss_type {loss_type} does not support --{flag} {value!r}: {why}. Fix: {fix}")

    if getattr(args, "use_liger_kernel", False):
        refuse("use_liger_kernel", True, "the fused Liger loss bypasses the policy loss", "drop --use_liger_kernel")
    from recipe.hf_step import check_sharding_backend  # torch-only, shared with the TRL adapter

    check_sharding_backend("recipe.swift", f"--loss_type {loss_type}", deepspeed=bool(getattr(args, "deepspeed", None)),
                           fsdp=bool(getattr(args, "fsdp", None)))
    level = getattr(args, "importance_sampling_level", "token")
    if level != "token":
        refuse("importance_sampling_level", level, "M2PO and FIPO are token-level losses",
               "--importance_sampling_level token")
    if float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:
        refuse("top_entropy_quantile", args.top_entropy_quantile, "the entropy mask is not part of these losses",
               "--top_entropy_quantile 1.0")
    if int(getattr(args, "sequence_parallel_size", 1) or 1) > 1:
        refuse("sequence_parallel_size", args.sequence_parallel_size,
               "the whole-step selection needs each rank's full sequences", "--sequence_parallel_size 1")
    for flag in ("padding_free", "packing"):
        if getattr(args, flag, False):
            refuse(flag, True, "ms-swift's packed (rmpad) layout puts a micro-batch's completions in one row, which "
                   "FIPO's per-sequence scan and drop cannot use, and it needs flash attention, so the adapter is "
                   "not tested with it", f"--{flag} false")
    if getattr(args, "off_policy_sequence_mask_delta", None) is not None:
        refuse("off_policy_sequence_mask_delta", args.off_policy_sequence_mask_delta,
               "M2PO/FIPO already decide which tokens of stale data count", "drop the flag")
    if getattr(args, "rollout_importance_sampling_mode", None) is not None:
        refuse("rollout_importance_sampling_mode", args.rollout_importance_sampling_mode,
               "the sampler's log-probs are already the behaviour policy of these losses (no extra IS correction)",
               "drop the flag")
    if getattr(args, "advantage_reweight", None) not in (None, "none"):
        refuse("advantage_reweight", args.advantage_reweight, "teacher reweighting is not implemented here",
               "drop the flag")
    for flag in ("teacher_model", "teacher_model_server", "multi_turn_scheduler"):
        if getattr(args, flag, None):
            refuse(flag, getattr(args, flag), "teacher distillation and multi-turn rollouts (a variable number of "
                   "samples per step) are not implemented with these losses", f"drop --{flag}")
    if float(getattr(args, "sdar_loss_coef", 0.0) or 0.0) > 0:
        refuse("sdar_loss_coef", args.sdar_loss_coef, "SDAR is not implemented with these losses", "set it to 0")
    if getattr(args, "chord_sft_dataset", None):
        refuse("chord_sft_dataset", args.chord_sft_dataset, "CHORD mixing is not implemented with these losses",
               "drop the flag")
    ga = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    spg = getattr(args, "steps_per_generation", None)
    if spg is not None and int(spg) % ga != 0:
        refuse("steps_per_generation", spg, f"an optimizer step ({ga} micro-batches) must lie inside one generation "
               "batch for the whole-step selection and token count", f"a multiple of --gradient_accumulation_steps {ga}")
    own = namesake_flags(loss_type)
    for flag, default, env in own:
        value = getattr(args, flag, default)
        if value != default:
            refuse(flag, value, f"that flag configures ms-swift's own {names[loss_type]}; {loss_type} reads its "
                   "settings from the environment", f"unset --{flag} and export {env}")
    if "delta" not in (flag for flag, _, _ in own) and getattr(args, "delta", None) is not None:
        refuse("delta", args.delta, "ms-swift's two-sided clip is not part of the loss's objective", "drop --delta")
    loss_config(loss_type, epsilon_low=float(getattr(args, "epsilon", 0.2)),
                epsilon_high=getattr(args, "epsilon_high", None))
