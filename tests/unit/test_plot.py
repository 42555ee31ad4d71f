"""stalerl.results.plot: the stalerl-plot CLI and plot_runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalerl.results.plot import PlotError, main, moving_average, plot_runs, resolve_metric_key

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _make_run(path: Path, n: int = 20, scale: float = 1.0, extra: bool = False) -> Path:
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as fh:
        for s in range(n):
            rec = {"step": s, "reward": scale * s / n, "actor/grad_norm": 1.0 / (s + 1), "hist": [s, 1]}
            if extra:
                rec["m2po/masked_fraction"] = 0.01 * s
            fh.write(json.dumps(rec) + "\n")
            if s % 5 == 0:
                fh.write(json.dumps({"step": s, "eval/acc": s / n}) + "\n")
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_cli_writes_png_with_one_subplot_per_metric(tmp_path, capsys):
    a = _make_run(tmp_path / "m2po_seed0", extra=True)
    b = _make_run(tmp_path / "grpo_seed0", scale=0.5)
    out1 = tmp_path / "two.png"
    assert main([str(a), str(b), "--out", str(out1)]) == 0  # default metrics: reward, grad_norm
    assert capsys.readouterr().out.strip() == str(out1)
    w, h2 = _png_size(out1)
    assert w > 0 and h2 > 0

    out3 = tmp_path / "three.png"
    rc = main([str(a), str(b), "--metrics", "reward", "grad_norm", "eval/acc", "--smooth", "5", "--out", str(out3)])
    assert rc == 0
    _, h3 = _png_size(out3)
    assert h3 > h2  # a third subplot makes the figure taller
    assert out3.stat().st_size > 1000


def test_missing_run_dir_is_a_clear_error(tmp_path, capsys):
    a = _make_run(tmp_path / "a")
    missing = tmp_path / "does_not_exist"
    assert main([str(a), str(missing), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "run directory not found" in err and str(missing) in err
    assert not (tmp_path / "x.png").exists()

    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_missing_metric_is_a_clear_error_naming_available_keys(tmp_path, capsys):
    a = _make_run(tmp_path / "a")
    assert main([str(a), "--metrics", "reward", "kl_div", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "'kl_div' not found" in err and "actor/grad_norm" in err and "reward" in err
    assert not (tmp_path / "x.png").exists()


def test_metric_missing_in_one_run_is_reported_and_the_rest_is_drawn(tmp_path):
    a = _make_run(tmp_path / "a", extra=True)
    b = _make_run(tmp_path / "b")
    warnings: list[str] = []
    out = plot_runs([a, b], ["masked_fraction"], tmp_path / "p.png", warn=warnings.append)
    assert out.stat().st_size > 0
    assert warnings == ["metric 'masked_fraction' not found in run 'b'; skipping it in that subplot"]


def test_labels_must_match_runs_and_are_used(tmp_path, capsys):
    a, b = _make_run(tmp_path / "a"), _make_run(tmp_path / "b")
    assert main([str(a), str(b), "--labels", "only_one", "--out", str(tmp_path / "x.png")]) == 2
    assert "1 labels for 2 runs" in capsys.readouterr().err
    assert main([str(a), str(b), "--labels", "M2PO", "GRPO", "--out", str(tmp_path / "x.png")]) == 0


def test_library_errors_and_helpers(tmp_path):
    a = _make_run(tmp_path / "a")
    with pytest.raises(PlotError, match="smooth"):
        plot_runs([a], ["reward"], tmp_path / "x.png", smooth=0)
    with pytest.raises(PlotError, match="ambiguous"):
        resolve_metric_key("loss", {"actor/loss", "critic/loss"})
    assert resolve_metric_key("grad_norm", {"actor/grad_norm", "reward"}) == "actor/grad_norm"
    assert resolve_metric_key("reward", {"reward", "x/reward"}) == "reward"
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0], 1) == [1.0, 2.0]


def test_python_dash_m_entry_point(tmp_path):
    a = _make_run(tmp_path / "run")
    out = tmp_path / "m.png"
    proc = subprocess.run(
        [sys.executable, "-m", "stalerl.results.plot", str(a), "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
