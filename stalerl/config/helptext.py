"""``--help``: usage, options and every config key with its type, default, choices and help, grouped by section."""

import dataclasses
from typing import Any, List, Optional

from omegaconf import OmegaConf

from stalerl.config.checks import _type_hints, _type_name, _unwrap_optional
from stalerl.config.errors import _deferred_checks
from stalerl.config.schema import ExperimentConfig


def _fmt_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def format_help(config_cls: type = ExperimentConfig, extra_flags: tuple[str, ...] = ()) -> str:
    """Usage, options, and every config key with its type, default, choices and help, grouped by section.
    ``extra_flags``: flags a caller handles itself (the launcher's ``--debug``), named in the usage line too."""
    import textwrap

    extra = "".join(f" [{f}]" for f in extra_flags)
    lines = [
        f"usage: python <script>.py [--config FILE.yaml] [key=value ...] [--dry-run] [--plot]{extra} [-h]",
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
