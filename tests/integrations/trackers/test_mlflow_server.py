"""stats_logger.mlflow against a real ``mlflow server`` (SQLite backend) that the test starts on a free loopback
port, queried back with MlflowClient: a trial killed (SIGKILL), resumed, stopped (SIGTERM) and resumed to its end is
one MLflow run whose metric histories equal metrics.jsonl, with the config as params, the summary as metrics and tags
and summary.json / config.yaml as artifacts; a server killed mid-run is one warning line and the run finishes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tracker_cases import (REPO, cmd, env, expected_rows, killed_sigtermed_resumed, overrides, require,
                           stalerl_lines, wandb_offline_run)

pytestmark = [pytest.mark.trackers, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlflow server`` with an SQLite backend and its artifacts under ``root``, on a free 127.0.0.1 port."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        mlflow_cli = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
        self.log = open(root / "server.log", "w")
        # its own process group: the server's workers go with it when it is killed
        self.proc = subprocess.Popen([mlflow_cli, "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                                      "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
                                      "--port", str(self.port), "--workers", "1"], cwd=root, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 240
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def server(tmp_path) -> Iterator[Server]:
    require("mlflow")
    srv = Server(tmp_path / "mlflow-server")
    try:
        yield srv
    finally:
        srv.kill()


def _client(url: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=url)


def test_mlflow_server_metrics_equal_metrics_jsonl_across_kill_sigterm_and_resume(tmp_path, server):
    """Both trackers at once: the MLflow run and the W&B offline run each end with exactly the file's rows."""
    require("wandb")
    run_dir, results = killed_sigtermed_resumed(tmp_path / "runs", "ml", **{
        "stats_logger.mlflow.enabled": True, "stats_logger.mlflow.tracking_uri": server.url,
        "stats_logger.mlflow.experiment": "tracker-test", "stats_logger.wandb.mode": "offline"})
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = _client(server.url)
    exp = client.get_experiment_by_name("tracker-test")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [state["run_id"]]  # the resumes continued the one run
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "ml"
    expected = expected_rows(run_dir)
    keys = sorted({k for _, values in expected for k in values})
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        want = [(step, values[key]) for step, values in expected if key in values]
        assert history == want, key  # every step once, the file's value
    assert run.data.params["actor.loss"] == "m2po" and run.data.params["total_train_steps"] == "8"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.data.metrics["summary/eval.final"] == summary["eval"]["final"]
    assert run.data.tags["summary/status"] == "finished"
    assert run.data.tags["summary/code.commit"] == str(summary["code"]["commit"]).replace("None", "null")
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["config.yaml", "summary.json"]
    assert wandb_offline_run(run_dir)["history"] == expected
    for res in results:
        assert "Traceback" not in res.stdout + res.stderr


def test_a_server_killed_mid_run_is_one_warning_and_the_run_finishes(tmp_path, server):
    root = tmp_path / "runs"
    args = overrides(root, "gone", **{"stats_logger.mlflow.enabled": True,
                                      "stats_logger.mlflow.tracking_uri": server.url, "recover.mode": "disabled",
                                      "total_train_steps": 12})
    run_dir = root / "gsm8k-m2po-cpu" / "gone"
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen(cmd(args), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 400
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.05)
        server.kill()
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    text = out + err
    warnings = stalerl_lines(text, "MLflow tracking stopped")
    assert len(warnings) == 1, text[-3000:]
    assert "metrics.jsonl and TensorBoard go on" in warnings[0]
    assert "Traceback" not in text
    assert [r[0] for r in expected_rows(run_dir)] == list(range(13))  # the file is whole
    json.loads((run_dir / "summary.json").read_text())  # and the summary written


def test_the_default_store_is_an_sqlite_database_beside_the_trial(tmp_path):
    require("mlflow")
    from tracker_cases import run

    root = tmp_path / "runs"
    res = run(overrides(root, "local", **{"stats_logger.mlflow.enabled": True, "recover.mode": "disabled",
                                          "total_train_steps": 3}))
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = root / "gsm8k-m2po-cpu" / "local"
    client = _client(f"sqlite:///{run_dir / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("gsm8k-m2po-cpu").experiment_id])
    for key in ("reward/consumed", "actor/loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        assert history == [(s, v[key]) for s, v in expected_rows(run_dir) if key in v]
    assert (run_dir / "mlflow-artifacts" / found.info.run_id / "artifacts" / "summary.json").is_file()
    assert not (REPO / "mlruns").exists() and not (REPO / "mlflow.db").exists()
