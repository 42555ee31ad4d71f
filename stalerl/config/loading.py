"""Loading: the command line, the YAML file and dotted ``key=value`` overrides merged over the schema, then checked."""

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from stalerl.config.checks import _did_you_mean, _format_problems, _type_name, _unwrap_optional, _walk_sections
from stalerl.config.errors import ConfigError, _deferred_checks
from stalerl.config.helptext import format_help
from stalerl.config.rules import validate
from stalerl.config.schema import ExperimentConfig, _schema
from stalerl.config.section import _Section
from stalerl.config.suggest import _suggest, _unknown_key_message


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
