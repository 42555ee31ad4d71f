"""Output: the resolved config as YAML, its atomic save, and the run directory."""

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Union

from omegaconf import OmegaConf

from stalerl.config.errors import _deferred_checks
from stalerl.config.schema import ExperimentConfig


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
