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

Layout (one concern per module; ``from stalerl.config import ...`` is the public interface):

- :mod:`~stalerl.config.errors`: ``ConfigError``, ``ConfigWarning`` and the deferred-checks switch.
- :mod:`~stalerl.config.checks`: one field's value checks (type, choices, bounds) and problem formatting.
- :mod:`~stalerl.config.section`: the ``_f`` field helper and ``_Section``, the base of every section.
- :mod:`~stalerl.config.backend`: backend strings and ``parse_backend``.
- :mod:`~stalerl.config.slurm`: ``SlurmConfig`` and the Slurm value checks (the Slurm scheduler imports them).
- :mod:`~stalerl.config.schema`: the other sections, ``ExperimentConfig`` and ``schema_keys``.
- :mod:`~stalerl.config.rules`: ``validate`` (cross-field rules and warnings), ``is_async`` and ``fipo_has_drift``.
- :mod:`~stalerl.config.suggest`: did-you-mean for unknown keys.
- :mod:`~stalerl.config.loading`: ``parse_args``, ``load_config``, ``apply_overrides`` (YAML + overrides).
- :mod:`~stalerl.config.output`: ``config_to_yaml``, ``save_resolved_config``, ``run_dir``.
- :mod:`~stalerl.config.helptext`: ``format_help``.

The package may import only ``stalerl.core`` and (lazily, for loss names) ``recipe``; inside it ``schema`` imports
``rules`` and never the other way round, so there is no import circle.
"""

import os  # noqa: F401 - kept as ``stalerl.config.os`` (tests patch os.fsync/os.replace through it)

from stalerl.config.backend import _DIM_NAMES, _GPU_ROLLOUT_ENGINES, ROLLOUT_ENGINES, TRAIN_ENGINES, Backend, parse_backend
from stalerl.config.checks import (
    _check_value,
    _did_you_mean,
    _format_problems,
    _is_interpolation,
    _type_hints,
    _type_name,
    _unwrap_optional,
    _walk_sections,
)
from stalerl.config.errors import _DEFER_CHECKS, ConfigError, ConfigWarning, _deferred_checks
from stalerl.config.helptext import _fmt_value, format_help
from stalerl.config.loading import (
    _FLAGS,
    _build,
    _merge_overrides,
    _merge_yaml,
    _nest,
    _oc_error,
    _override_value,
    _yaml_keys,
    apply_overrides,
    load_config,
    parse_args,
)
from stalerl.config.output import config_to_yaml, run_dir, save_resolved_config
from stalerl.config.rules import (
    _cross_field_problems,
    _cross_field_warnings,
    _resolve_python_interpolations,
    fipo_has_drift,
    is_async,
    validate,
)
from stalerl.config.schema import (
    NORM_LEVELS,
    ActorConfig,
    ClusterConfig,
    DatasetConfig,
    EvaluatorConfig,
    ExperimentConfig,
    GenerationConfig,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    RecoverConfig,
    RolloutConfig,
    SaverConfig,
    SchedulerConfig,
    StatsLoggerConfig,
    SyntheticDataConfig,
    TinyModelConfig,
    VLLMConfig,
    WarmStartConfig,
    _schema,
    schema_keys,
)
from stalerl.config.section import _f, _Section
from stalerl.config.slurm import SlurmConfig, slurm_config_problems
from stalerl.config.suggest import _RENAMED, _suggest, _unknown_key_message

# Tracebacks and warnings name these by their module: keep the public one (``stalerl.config.ConfigError``).
ConfigError.__module__ = __name__
ConfigWarning.__module__ = __name__

__all__ = [
    "ActorConfig",
    "fipo_has_drift",
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
    "VLLMConfig",
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
