"""stalerl.results.metrics_log: JSONL metrics, resume truncation, TensorBoard mirror, progress/summary helpers."""

from __future__ import annotations

import io
import logging
import math

import numpy as np
import pytest
import torch

from stalerl.results.metrics_log import (MetricsLogger, Progress, format_summary, is_interactive, lookup_metric,
                                         read_metrics)


def _metrics(step: int) -> dict:
    return {
        "reward": 0.1 * step,
        "actor/grad_norm": torch.tensor(1.0 + step),
        "staleness/hist": [step, 1, 0],
        "n": np.int64(step),
    }


def test_log_appends_one_line_per_call(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(0, _metrics(0))
        log.log(1, _metrics(1))
        log.log(1, {"eval/acc": 0.5})  # eval metrics in their own line for the same step
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    recs = read_metrics(tmp_path)
    assert recs == read_metrics(tmp_path / "metrics.jsonl")
    assert list(recs[0]) == ["step", "reward", "actor/grad_norm", "staleness/hist", "n"]
    assert recs[1] == {"step": 1, "reward": 0.1, "actor/grad_norm": 2.0, "staleness/hist": [1, 1, 0], "n": 1}
    assert recs[2] == {"step": 1, "eval/acc": 0.5}
    assert not (tmp_path / "tensorboard").exists()


def test_step_key_in_metrics_is_rejected(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="step"):
        log.log(3, {"step": 4, "reward": 1.0})
    log.close()
    with pytest.raises(RuntimeError):
        log.log(4, {"reward": 1.0})


def test_resume_truncation_reproduces_uninterrupted_file(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    with MetricsLogger(full, tensorboard=False) as log:
        for s in range(10):
            log.log(s, _metrics(s))
            if s % 4 == 0:
                log.log(s, {"eval/acc": s / 10, "nan": float("nan")})

    # The killed run got to step 7 (and was torn mid-line) but its newest checkpoint is step 5.
    log = MetricsLogger(killed, tensorboard=False)
    for s in range(8):
        log.log(s, _metrics(s))
        if s % 4 == 0:
            log.log(s, {"eval/acc": s / 10, "nan": float("nan")})
    with open(killed / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 8, "rew')
    with MetricsLogger(killed, tensorboard=False, resume_step=5) as log:
        assert [r["step"] for r in read_metrics(killed)] == [0, 0, 1, 2, 3, 4, 4, 5]
        for s in range(6, 10):
            log.log(s, _metrics(s))
            if s % 4 == 0:
                log.log(s, {"eval/acc": s / 10, "nan": float("nan")})

    assert (killed / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    assert math.isnan(read_metrics(killed)[1]["nan"])


def test_resume_without_existing_file_and_fresh_start_appends(tmp_path):
    MetricsLogger(tmp_path, tensorboard=False, resume_step=3).close()  # nothing to truncate: fine
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(0, {"a": 1})
    with MetricsLogger(tmp_path, tensorboard=False) as log:  # no resume_step: never destructive
        log.log(1, {"a": 2})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_read_metrics_skips_malformed_lines_and_reports_missing_file(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "a": 1}\n\nnot json\n{"no_step": 1}\n{"step": 2, "a": 3}\n')
    with caplog.at_level(logging.WARNING, logger="stalerl.results.metrics_log"):
        recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [0, 2]
    assert len(caplog.records) == 2
    with pytest.raises(FileNotFoundError, match="nope"):
        read_metrics(tmp_path / "nope")


def test_tensorboard_gets_scalars_only_and_is_purged_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        for s in range(4):
            log.log(s, _metrics(s) | {"text": "hello", "flag": True})
    with MetricsLogger(tmp_path, resume_step=1) as log:
        log.log(2, {"reward": 42.0})

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward", "actor/grad_norm", "n", "flag"} <= tags
    assert "staleness/hist" not in tags and "text" not in tags
    rewards = {e.step: e.value for e in acc.Scalars("reward")}
    assert rewards == pytest.approx({0: 0.0, 1: 0.1, 2: 42.0})  # steps 2, 3 of the first run were purged
    assert [e.value for e in acc.Scalars("actor/grad_norm")] == [1.0, 2.0]


def test_format_summary():
    m = {"reward": 0.123456, "actor/grad_norm": 12345.678, "hist": [1, 2], "loss": float("nan")}
    line = format_summary(10, m, ["reward", "grad_norm", "hist", "missing", "loss"], total=100)
    assert line == "step 10/100 | reward=0.1235 | grad_norm=1.235e+04 | loss=nan"
    assert format_summary(3, {}, ["reward"]) == "step 3"


def test_lookup_metric_prefers_exact_then_unique_suffix():
    assert lookup_metric({"grad_norm": 1, "actor/grad_norm": 2}, ["grad_norm"]) == 1
    assert lookup_metric({"actor/grad_norm": 2}, ["grad_norm"]) == 2
    assert lookup_metric({"a/grad_norm": 2, "b/grad_norm": 3}, ["grad_norm"]) is None  # ambiguous


def test_progress_bar_shows_key_numbers_and_tracks_absolute_steps():
    pytest.importorskip("tqdm")
    buf = io.StringIO()
    bar = Progress(100, True, initial=10, file=buf, interactive=True)
    assert bar.enabled
    bar.update(12, {"reward": 0.5, "actor/grad_norm": torch.tensor(2.25), "staleness": 3, "m2po/masked_fraction": 0.01})
    assert bar._bar.n == 12
    bar.update(15, {"reward": 0.75})
    assert bar._bar.n == 15
    assert bar.postfix({"eval/acc": 0.9, "actor/pg_loss": -0.1}) == {"eval_acc": "0.9", "loss": "-0.1"}
    bar.close()
    final = buf.getvalue().rstrip("\n").split("\r")[-1]  # what the bar shows last
    # reward was updated; the other numbers are kept from the earlier step
    assert "15/100" in final and "reward=0.75" in final
    assert "gnorm=2.25" in final and "stale=3" in final and "masked=0.01" in final

    off = Progress(100, enabled=False)
    assert not off.enabled
    off.update(5, {"reward": 1.0})  # no-op, no error
    off.close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    assert is_interactive(_Terminal()) and not is_interactive(io.StringIO())
    tty = _Terminal()
    with Progress(50, True, file=tty) as bar:
        assert bar.interactive
        for step in range(1, 51):
            bar.update(step, {"reward": 0.5})
    assert tty.getvalue().count("\rtrain:") >= 2 and "50/50" in tty.getvalue()  # the live bar redraws in place
    monkeypatch.setenv("CI", "true")  # a CI log is read afterwards, line by line, even through a pseudo-terminal
    assert not is_interactive(_Terminal()) and not Progress(50, True, file=_Terminal()).interactive
    monkeypatch.setenv("CI", "false")
    monkeypatch.setenv("TERM", "dumb")
    assert not is_interactive(_Terminal())


def test_plain_progress_prints_a_line_every_tenth_and_at_the_end_without_carriage_returns():
    buf = io.StringIO()
    with Progress(95, True, file=buf) as bar:  # a StringIO is no terminal: plain lines
        assert bar.enabled and not bar.interactive
        for step in range(1, 96):
            bar.update(step, {"reward": step / 100, "eval/accuracy": 0.5} if step % 20 == 0 else {"reward": step / 100})
    out = buf.getvalue()
    assert "\r" not in out and out.endswith("\n")
    lines = out.splitlines()
    # every ceil(95 / 10) = 10 steps, and the last step, each exactly once
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]
    assert lines[0].startswith("train: 10/95 steps (11%) | ") and "elapsed, ~" in lines[0] and "reward=0.1" in lines[0]
    assert "eval_acc=0.5" in lines[2]  # sticky: shown since step 20's eval, although step 30 had no eval metrics
    assert lines[-1].startswith("train: 95/95 steps (100%) | ") and "left" not in lines[-1]


def test_plain_progress_counts_from_the_resumed_step_and_matches_a_literal_schedule():
    for total, initial in [(300, 0), (300, 137), (7, 0), (1, 0), (25, 24), (1000, 999)]:
        buf = io.StringIO()
        bar = Progress(total, True, initial=initial, file=buf, interactive=False)
        for step in range(initial + 1, total + 1):
            bar.update(step)
        bar.close()
        printed = [int(line.split()[1].split("/")[0]) for line in buf.getvalue().splitlines()]
        every = -(-total // 10)  # literal reference: the multiples of ceil(total / 10) after `initial`, plus the end
        expected = sorted({s for s in range(initial + 1, total + 1) if s % every == 0} | {total})
        assert printed == expected, (total, initial)
    quiet = io.StringIO()
    Progress(100, enabled=False, file=quiet).update(100, {"reward": 1.0})
    assert quiet.getvalue() == ""


def test_loss_fraction_keys_find_any_losss_headline_fraction_and_nothing_else():
    from stalerl.results.metrics_log import loss_fraction_keys

    keys = {"actor/m2po/masked_fraction", "actor/m2po/would_clip_fraction", "actor/m2po/masked_fraction_pos_r_gt_1",
            "actor/my_plugin/clip_fraction", "actor/loss", "m2po/masked_fraction", "actor/a/b/clip_fraction"}
    assert loss_fraction_keys(keys) == ["actor/m2po/masked_fraction", "actor/my_plugin/clip_fraction"]
    assert loss_fraction_keys(keys, "clip_fraction") == ["actor/my_plugin/clip_fraction"]
    assert loss_fraction_keys({"actor/loss"}) == []


def test_a_sweep_row_reads_the_fraction_of_a_loss_the_runtime_does_not_know(tmp_path):
    import json

    from stalerl.results.sweep import summarize_run

    rows = [{"step": s, "actor/my_plugin/clip_fraction": 0.1 * s, "actor/loss": 1.0} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = summarize_run(tmp_path, "finished", tail_fraction=0.5)
    assert row["clip_fraction"] == pytest.approx((0.3 + 0.4) / 2) and row["masked_fraction"] is None
