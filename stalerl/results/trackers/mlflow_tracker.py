"""``stats_logger.mlflow``: params (the resolved config flattened), metrics with their steps, the summary as
metrics and tags, ``summary.json`` and ``config.yaml`` as artifacts. ``mlflow`` is imported here only.

The highest step logged is kept as the run's tag ``stalerl.last_step``, written in the same ``log_batch`` request as
the metrics, so a resumed trial reads from the server what the run holds.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from stalerl.results.trackers.base import Row, Tracker, flatten, scalar_metrics, summary_items

LAST_STEP_TAG = "stalerl.last_step"
TRIAL_TAG = "stalerl.trial"
# MLflow's limits per log_batch request
_BATCH_METRICS, _BATCH_PARAMS, _BATCH_TAGS = 1000, 100, 100
_PARAM_VALUE_CHARS = 6000
# A server that is gone must cost seconds, not MLflow's default minutes of retries, before the one warning line.
_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
             "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
_STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED", "diverged": "FAILED"}


def tracking_uri(cfg: Any, run_dir: Path) -> str:
    """stats_logger.mlflow.tracking_uri, else an SQLite database beside the trial. A plain local path (no scheme)
    is made absolute, so it does not depend on the working directory."""
    uri = cfg.stats_logger.mlflow.tracking_uri
    if not uri:
        return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
    if "://" not in uri and not uri.startswith("file:"):
        return str(Path(uri).expanduser().resolve())
    return uri


def _key(name: str) -> str:
    """An MLflow metric/param name: letters, digits, ``_ - . / space`` (other characters become ``_``)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", name)


def _chunks(items: List[Any], n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


class MLflowTracker(Tracker):
    name = "MLflow"
    key = "mlflow"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.client: Any = None
        self.run_id = ""
        self.uri = ""
        self._last: Optional[int] = None

    def start(self, run_dir: Any, state: Optional[Mapping[str, Any]], log) -> Dict[str, Any]:
        for k, v in _HTTP_ENV.items():
            os.environ.setdefault(k, v)
        from mlflow.tracking import MlflowClient

        from stalerl.results.run_summary import _config_dict as config_dict

        c = self.cfg.stats_logger.mlflow
        run_dir = Path(run_dir)
        self.uri = tracking_uri(self.cfg, run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        if state and state.get("run_id") and state.get("tracking_uri") == self.uri:
            self.run_id = str(state["run_id"])
            run = self.client.get_run(self.run_id)
            last = run.data.tags.get(LAST_STEP_TAG)
            self._last = int(last) if last not in (None, "") else None
            self.client.update_run(self.run_id, status="RUNNING")
            log(f"stalerl: MLflow run {self.run_id} continues at {self.uri} (experiment {self.experiment_name()})")
        else:
            exp_id = self._experiment_id()
            run = self.client.create_run(exp_id, run_name=c.run_name or self.cfg.trial_name,
                                         tags={TRIAL_TAG: str(run_dir)})
            self.run_id = run.info.run_id
            self._log_params(config_dict(self.cfg))
            log(f"stalerl: MLflow run {self.run_id} started at {self.uri} (experiment {self.experiment_name()})")
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def experiment_name(self) -> str:
        return self.cfg.stats_logger.mlflow.experiment or self.cfg.experiment_name

    def _experiment_id(self) -> str:
        name = self.experiment_name()
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        # An SQLite store keeps the artifacts beside its database (the trial's directory by default); MLflow's own
        # default would be ./mlruns in whatever the working directory is. A file store or a server decides itself.
        where = None
        if self.uri.startswith("sqlite:///"):
            where = (Path(self.uri[len("sqlite:///"):]).resolve().parent / "mlflow-artifacts").as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=where)
        except Exception:  # noqa: BLE001 - another trial of the study created it meanwhile
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _log_params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(_key(k), str(v)[:_PARAM_VALUE_CHARS]) for k, v in flatten(config)]
        for chunk in _chunks(params, _BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=chunk)

    def last_step(self) -> Optional[int]:
        return self._last

    def log_rows(self, rows: Sequence[Row]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        metrics = [Metric(_key(k), v, now, int(step)) for step, values in rows
                   for k, v in scalar_metrics(values).items()]
        if not rows:
            return
        last = max(int(step) for step, _ in rows)
        chunks = list(_chunks(metrics, _BATCH_METRICS)) or [[]]
        for i, chunk in enumerate(chunks):
            # the step mark goes with the last chunk: a failure before it leaves the mark at the old step, and the
            # resumed trial logs those steps again (MLflow keeps both copies of a re-logged step; rare: >1000 keys)
            tags = [RunTag(LAST_STEP_TAG, str(last))] if i == len(chunks) - 1 else []
            self.client.log_batch(self.run_id, metrics=chunk, tags=tags)
        self._last = last

    def finish(self, status: str, summary: Optional[Mapping[str, Any]], files: Sequence[Any]) -> None:
        from mlflow.entities import Metric, RunTag

        if summary:
            numbers_, texts = summary_items(summary)
            now = int(time.time() * 1000)
            step = self._last or 0
            metrics = [Metric(_key(k), v, now, step) for k, v in numbers_.items()]
            tags = [RunTag(_key(k), v[:5000]) for k, v in texts.items()]
            for chunk in _chunks(metrics, _BATCH_METRICS):
                self.client.log_batch(self.run_id, metrics=chunk)
            for chunk in _chunks(tags, _BATCH_TAGS):
                self.client.log_batch(self.run_id, tags=chunk)
        for path in files:
            if Path(path).is_file():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status=_STATUS.get(status, "FAILED"))
