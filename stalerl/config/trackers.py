"""``stats_logger.wandb`` and ``stats_logger.mlflow``: experiment trackers beside JSONL and TensorBoard
(docs/tracking.md).

Torch-free and import-free: neither ``wandb`` nor ``mlflow`` is imported unless a tracker is enabled
(stalerl.results.tracking); an enabled tracker whose package is missing is refused here, when the config is loaded,
before any work (found with importlib.util.find_spec, which does not import it)."""

import importlib.util
from dataclasses import dataclass
from typing import List, Optional, Tuple

from stalerl.config.section import _f, _Section


def _missing(module: str, key: str, value: str, extra: str) -> List[Tuple[str, str]]:
    if importlib.util.find_spec(module) is not None:
        return []
    return [(key, f"got {value}, which needs the {module} package, not installed here. Fix: pip install "
                  f"'stalerl[{extra}]', or turn the tracker off.")]


@dataclass
class WandbConfig(_Section):
    """Weights & Biases run tracking (pip install 'stalerl[wandb]')."""

    mode: str = _f("disabled", choices=("disabled", "offline", "online"),
                   help="disabled = no W&B; offline = a local run directory that `wandb sync` uploads later; "
                        "online = log to the W&B server (needs WANDB_API_KEY or `wandb login`).")
    project: str = _f("stalerl", help="W&B project.")
    entity: Optional[str] = _f(None, help="W&B entity (user or team); null = the logged-in default.")
    name: Optional[str] = _f(None, help="Run name; null = {experiment_name}/{trial_name}.")
    group: Optional[str] = _f(None, help="Run group; null = experiment_name (a sweep's or a study's trials group "
                                         "together; stalerl-study passes the study name).")
    tags: List[str] = _f(factory=list, help="Run tags.")
    dir: Optional[str] = _f(None, help="Where W&B writes its wandb/ folder; null = the run directory.")

    def _check(self) -> List[Tuple[str, str]]:
        if self.mode == "disabled":
            return []
        return _missing("wandb", "mode", repr(self.mode), "wandb")


@dataclass
class MLflowConfig(_Section):
    """MLflow run tracking (pip install 'stalerl[mlflow]')."""

    enabled: bool = _f(False, help="Log params, metrics, the summary and artifacts to MLflow.")
    tracking_uri: Optional[str] = _f(None, help="A local path, sqlite:///..., or a server URL (http://host:port); "
                                                "null = sqlite:///{run_dir}/mlflow.db beside the trial.")
    experiment: Optional[str] = _f(None, help="MLflow experiment; null = experiment_name (stalerl-study passes the "
                                              "study name).")
    run_name: Optional[str] = _f(None, help="Run name; null = the trial name.")

    def _check(self) -> List[Tuple[str, str]]:
        if not self.enabled:
            return []
        return _missing("mlflow", "enabled", "true", "mlflow")
