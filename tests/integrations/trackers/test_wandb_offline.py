"""stats_logger.wandb against the real wandb package, offline: a trial killed (SIGKILL), resumed, stopped (SIGTERM)
and resumed to its end is one W&B run whose history, read back with wandb's own reader (``wandb leet inspect``), has
exactly the rows of metrics.jsonl, each step once."""

from __future__ import annotations

import json

import pytest

from tracker_cases import expected_rows, killed_sigtermed_resumed, require, wandb_offline_run

pytestmark = [pytest.mark.trackers, pytest.mark.slow]


def test_wandb_offline_history_equals_metrics_jsonl_across_kill_sigterm_and_resume(tmp_path):
    require("wandb")
    run_dir, results = killed_sigtermed_resumed(tmp_path / "runs", "wb", **{"stats_logger.wandb.mode": "offline",
                                                                          "stats_logger.wandb.tags": "[a,b]"})
    wb = wandb_offline_run(run_dir)
    run_id, history, summary, exits = wb["id"], wb["history"], wb["summary"], wb["exits"]
    assert len(wb["sessions"]) == 3  # one per process, one run id: `wandb sync` uploads them in order as one run
    for record in wb["runs"]:
        assert record["run_id"] == run_id and record["run_group"] == "gsm8k-m2po-cpu"
        assert record["config"]["update"]["actor"]["loss"] == "m2po"
    expected = expected_rows(run_dir)
    assert [s for s, _ in expected] == list(range(0, 9))
    assert [s for s, _ in history] == [s for s, _ in expected]  # every step once: none lost, none twice
    assert history == expected
    assert summary["summary/status"] == "finished" and summary["summary/steps_done"] == 8
    assert summary["summary/eval.final"] == json.loads((run_dir / "summary.json").read_text())["eval"]["final"]
    # the SIGKILLed session never ended; the SIGTERMed one ended interrupted (1), the last one finished (0)
    assert exits == [1, 0]
    for res in results[1:]:
        text = res.stdout + res.stderr
        assert f"wandb sync {run_dir}/wandb/offline-run-*-{run_id}" in text, text[-2000:]
        assert "Traceback" not in text
