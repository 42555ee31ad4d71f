"""This project's losses (every loss of ``recipe.registry``: M2PO, the reference FIPO, the baselines, plugins) inside
ms-swift's GRPO (HF backend), exact at the optimizer step.

Use::

    swift rlhf --rlhf_type grpo --loss_type m2po --external_plugins "$(python -m recipe.swift)" ...
    STALERL_M2_THRESHOLD=0.02 swift rlhf ... --loss_type m2po ...
    swift rlhf ... --loss_type fipo_ref ...     # the reference FIPO; ms-swift's own ``fipo`` is unchanged

``python -m recipe.swift`` prints the plugin file's path. Importing this package needs neither torch nor ms-swift;
:mod:`recipe.swift.trainer` (imported by the plugin) needs both. Details: docs/integrations/swift.md.
"""

from typing import Any

from recipe.swift.config import check_swift_args, loss_config


def __getattr__(name: str) -> Any:
    if name in ("ENV_KEYS", "LOSS_TYPES"):  # generated from the registry's declarations when asked
        from recipe.swift import config

        return getattr(config, name)
    raise AttributeError(f"module 'recipe.swift' has no attribute {name!r}")


def plugin_path() -> str:
    """Absolute path of the file to pass to ms-swift's ``--external_plugins``."""
    from recipe.swift.plugin import PLUGIN_FILE

    return str(PLUGIN_FILE)


__all__ = ["ENV_KEYS", "LOSS_TYPES", "check_swift_args", "loss_config", "plugin_path"]
