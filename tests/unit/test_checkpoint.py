"""Atomic writes (stalerl.core.io) and crash-safe checkpoints (stalerl.training.checkpoint)."""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stalerl.training import checkpoint as ckpt
from stalerl.training.checkpoint import (
    CheckpointError,
    capture_rng_state,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from stalerl.core.io import append_jsonl, atomic_torch_save, atomic_write_bytes, atomic_write_text

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ckpt_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())


def _state(step: int) -> dict:
    return {"w": torch.full((4, 3), float(step)), "step": step}


# --------------------------------------------------------------------------------------------------- stalerl.core.io


def test_atomic_write_text_replaces_content(tmp_path):
    p = tmp_path / "sub" / "f.txt"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert os.listdir(p.parent) == ["f.txt"]  # no temp files left behind


def test_atomic_write_keeps_old_file_if_writer_dies_before_replace(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    atomic_write_bytes(p, b"old")

    def boom(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        atomic_write_bytes(p, b"new" * 1000)
    with pytest.raises(OSError, match="simulated"):
        atomic_torch_save({"x": torch.ones(3)}, p)
    monkeypatch.undo()
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]  # the temp files were removed


def test_atomic_write_keeps_old_file_if_serialization_fails(tmp_path):
    p = tmp_path / "state.pt"
    atomic_torch_save({"x": torch.arange(3)}, p)
    with pytest.raises(Exception):
        atomic_torch_save({"f": lambda: 0}, p)  # lambdas cannot be pickled: fails mid-write
    assert torch.equal(torch.load(p)["x"], torch.arange(3))
    assert os.listdir(tmp_path) == ["state.pt"]


def test_append_jsonl_converts_scalars_and_keeps_nan(tmp_path):
    p = tmp_path / "m.jsonl"
    append_jsonl(
        p,
        {
            "t": torch.tensor(1.5),
            "t1": torch.tensor([2]),
            "n": np.float32(0.25),
            "i": np.int64(7),
            "arr": np.arange(3),
            "nested": [torch.tensor(1), (2, 3)],
            "nan": float("nan"),
            "inf": float("inf"),
        },
    )
    append_jsonl(p, {"k": 1})
    lines = p.read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert rec["t"] == 1.5 and isinstance(rec["t"], float)
    assert rec["t1"] == [2] and rec["n"] == 0.25 and rec["i"] == 7 and isinstance(rec["i"], int)
    assert rec["arr"] == [0, 1, 2] and rec["nested"] == [1, [2, 3]]
    assert math.isnan(rec["nan"]) and rec["inf"] == math.inf


def test_append_jsonl_after_torn_line_starts_a_new_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n{"step": 1, "rew')  # a writer killed mid-line
    append_jsonl(p, {"step": 2})
    lines = p.read_text().splitlines()
    assert lines[0] == '{"step": 0}' and json.loads(lines[2]) == {"step": 2}


# ------------------------------------------------------------------------------------------------- checkpoints


def test_round_trip_tensors_and_python_objects(tmp_path):
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    fifo = collections.deque([{"ids": torch.arange(6).view(2, 3), "version": 4}, {"ids": torch.zeros(1), "version": 5}])
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": capture_rng_state(),
        "counters": {"samples": 1234, "tokens": 10**12},
        "data_position": ("epoch", 2, 17),
        "fifo": fifo,
        "note": "hello",
    }
    path = save_checkpoint(tmp_path, 7, state)
    assert path == tmp_path / "checkpoints" / "step_7"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_7"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 7 and meta["torch_version"] == torch.__version__ and len(meta["sha256"]) == 64

    step, loaded = load_latest_checkpoint(tmp_path)
    assert step == 7
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    for pid, s in state["optim"]["state"].items():
        assert torch.equal(loaded["optim"]["state"][pid]["exp_avg"], s["exp_avg"])
    assert loaded["counters"] == state["counters"] and loaded["data_position"] == ("epoch", 2, 17)
    assert isinstance(loaded["fifo"], collections.deque) and [b["version"] for b in loaded["fifo"]] == [4, 5]
    assert torch.equal(loaded["fifo"][0]["ids"], fifo[0]["ids"])
    assert loaded["note"] == "hello"
    # the restored optimizer state is usable
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(loaded["optim"])


def test_load_latest_on_empty_run_dir_is_none(tmp_path):
    assert load_latest_checkpoint(tmp_path) is None
    assert list_checkpoints(tmp_path) == []


def test_keep_last_prunes_older_checkpoints(tmp_path):
    for s in range(1, 6):
        save_checkpoint(tmp_path, s * 10, _state(s * 10), keep_last=2)
    assert _ckpt_dirs(tmp_path) == ["step_40", "step_50"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50]
    save_checkpoint(tmp_path, 60, _state(60), keep_last=3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50, 60]
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 70, _state(70), keep_last=0)


def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, _state(1))
    path2 = save_checkpoint(tmp_path, 2, _state(2))
    data = bytearray((path2 / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip one byte in the middle
    (path2 / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(path2)
    with caplog.at_level(logging.WARNING, logger="stalerl.training.checkpoint"):
        step, state = load_latest_checkpoint(tmp_path)
    assert step == 1 and torch.equal(state["w"], _state(1)["w"])
    assert any("falling back to step_1" in r.getMessage() for r in caplog.records)


def test_truncated_state_and_missing_meta_fall_back(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, _state(1), keep_last=3)
    save_checkpoint(tmp_path, 2, _state(2), keep_last=3)
    p3 = save_checkpoint(tmp_path, 3, _state(3), keep_last=3)
    (p3 / "meta.json").unlink()
    p2 = tmp_path / "checkpoints" / "step_2"
    (p2 / "state.pt").write_bytes((p2 / "state.pt").read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="stalerl.training.checkpoint"):
        assert load_latest_checkpoint(tmp_path)[0] == 1
    assert any("step_3" in r.getMessage() and "step_2" in r.getMessage() for r in caplog.records)


def test_nothing_valid_returns_none_with_warning(tmp_path, caplog):
    p = save_checkpoint(tmp_path, 1, _state(1))
    (p / "state.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="stalerl.training.checkpoint"):
        assert load_latest_checkpoint(tmp_path) is None
    assert any("no valid checkpoint" in r.getMessage() for r in caplog.records)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftover_tmp_directory_is_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    root = tmp_path / "checkpoints"
    leftover = root / f"step_2.tmp-{_dead_pid()}"
    leftover.mkdir()
    (leftover / "state.pt").write_bytes(b"half written")
    assert load_latest_checkpoint(tmp_path)[0] == 1  # ignored by the loader ...
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert leftover.exists()  # ... which never modifies the directory
    save_checkpoint(tmp_path, 2, _state(2))
    assert not leftover.exists()  # ... and removed by the next save
    assert _ckpt_dirs(tmp_path) == ["step_1", "step_2"]
    assert torch.equal(load_latest_checkpoint(tmp_path)[1]["w"], _state(2)["w"])


def test_tmp_directory_of_a_live_process_is_left_alone(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        foreign = tmp_path / "checkpoints" / f"step_2.tmp-{proc.pid}"
        foreign.mkdir()
        save_checkpoint(tmp_path, 2, _state(2))
        assert foreign.exists()
    finally:
        proc.kill()
        proc.wait()


def test_uncommitted_directory_newer_than_latest_is_ignored_then_pruned(tmp_path):
    # Killed after renaming step_3 into place but before `latest` was updated: step_3 was never committed.
    for s in (1, 2, 3):
        save_checkpoint(tmp_path, s, _state(s), keep_last=3)
    atomic_write_text(tmp_path / "checkpoints" / "latest", "step_2\n")
    assert load_latest_checkpoint(tmp_path)[0] == 2
    save_checkpoint(tmp_path, 5, _state(5), keep_last=3)
    assert _ckpt_dirs(tmp_path) == ["step_1", "step_2", "step_5"]


def test_resaving_same_step_and_rewinding(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    save_checkpoint(tmp_path, 2, _state(2))
    save_checkpoint(tmp_path, 2, {"w": torch.zeros(2), "step": 2, "second": True})
    step, state = load_latest_checkpoint(tmp_path)
    assert step == 2 and state["second"] is True
    assert _ckpt_dirs(tmp_path) == ["step_1", "step_2"]  # no .old copy left behind
    # Rewind (resumed from step 1): saving step 1 again drops the abandoned step 2.
    save_checkpoint(tmp_path, 1, _state(1))
    assert _ckpt_dirs(tmp_path) == ["step_1"]
    assert load_latest_checkpoint(tmp_path)[0] == 1


def test_killed_between_the_two_renames_of_a_resave_uses_the_moved_aside_copy(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, _state(1))
    save_checkpoint(tmp_path, 2, _state(2))
    root = tmp_path / "checkpoints"
    os.replace(root / "step_2", root / f"step_2.old-{_dead_pid()}")  # step_2 moved aside, new one never arrived
    with caplog.at_level(logging.WARNING, logger="stalerl.training.checkpoint"):
        step, state = load_latest_checkpoint(tmp_path)
    assert step == 2 and torch.equal(state["w"], _state(2)["w"])
    save_checkpoint(tmp_path, 3, _state(3))
    assert _ckpt_dirs(tmp_path) == ["step_2", "step_3"]  # the aside copy was kept and renamed back
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]


def test_missing_pointer_uses_newest_valid(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    save_checkpoint(tmp_path, 2, _state(2))
    (tmp_path / "checkpoints" / "latest").unlink()
    assert load_latest_checkpoint(tmp_path)[0] == 2


def test_rng_capture_restore_reproduces_draws():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    saved = capture_rng_state()
    first = (random.random(), np.random.rand(3).tolist(), torch.rand(4), torch.randint(0, 100, (5,)))
    # advance every generator, then restore
    random.random(), np.random.rand(10), torch.rand(10)
    restore_rng_state(saved)
    second = (random.random(), np.random.rand(3).tolist(), torch.rand(4), torch.randint(0, 100, (5,)))
    assert first[0] == second[0] and first[1] == second[1]
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])


def test_rng_state_survives_a_checkpoint(tmp_path):
    torch.manual_seed(123)
    random.seed(123)
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    restore_rng_state(load_latest_checkpoint(tmp_path)[1]["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from stalerl.training.checkpoint import save_checkpoint, load_latest_checkpoint

    run_dir = sys.argv[1]
    got = load_latest_checkpoint(run_dir)
    step = got[0] if got else 0
    while True:
        step += 1
        state = {
            "step": step,
            "w": torch.full((512, 1024), float(step)),      # 2 MiB: saving takes long enough to be interrupted
            "fifo": [torch.arange(step % 5 + 1)] * 3,
            "meta": {"lr": 0.5 * step, "name": f"s{step}"},
        }
        save_checkpoint(run_dir, step, state, keep_last=2)
    """
)


def test_sigkill_during_save_loop_always_leaves_a_valid_latest(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    rng = random.Random(1234)
    last_step = 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(run_dir)], env=env, stderr=subprocess.PIPE)
        try:
            # Wait until this child has committed something new, then kill it at a random moment.
            deadline = time.monotonic() + 60
            while True:
                cur = ckpt._read_latest_step(run_dir / "checkpoints") if (run_dir / "checkpoints").exists() else None
                if cur is not None and cur > last_step:
                    break
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "child made no progress"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stderr.close()
        # `latest` itself must name a complete checkpoint (not merely one the hash fallback can recover from).
        pointer = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert load_checkpoint(run_dir / "checkpoints" / pointer)[0] == int(pointer.split("_")[1])
        got = load_latest_checkpoint(run_dir)
        assert got is not None
        step, state = got
        assert f"step_{step}" == pointer
        assert step > last_step  # progress is never lost
        assert state["step"] == step
        assert torch.equal(state["w"], torch.full((512, 1024), float(step)))
        assert all(torch.equal(t, torch.arange(step % 5 + 1)) for t in state["fifo"])
        assert state["meta"] == {"lr": 0.5 * step, "name": f"s{step}"}
        last_step = step
    # A kill may land mid-prune or mid-write; the next clean save tidies up everything the victims left behind.
    save_checkpoint(run_dir, last_step + 1, {"step": last_step + 1}, keep_last=2)
    assert set(_ckpt_dirs(run_dir)) == {f"step_{last_step}", f"step_{last_step + 1}"}


def test_checkpoints_are_due_by_steps_or_by_minutes_since_the_last_one(monkeypatch):
    """recover.freq_minutes: a checkpoint at the end of the first step that ends that long after the last one."""
    from types import SimpleNamespace

    from stalerl.training.trainer import Trainer

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])

    def due(step, *, mode="auto", freq_steps=50, freq_minutes=None, saved_at=1000.0):
        t = SimpleNamespace(cfg=SimpleNamespace(recover=SimpleNamespace(mode=mode, freq_steps=freq_steps,
                                                                        freq_minutes=freq_minutes)),
                            last_saved_at=saved_at)
        return Trainer.checkpoint_due(t, step)

    assert due(50) and not due(49)
    assert not due(49, freq_minutes=10)  # no time has passed
    now[0] += 599.0
    assert not due(49, freq_minutes=10)
    now[0] += 1.0
    assert due(49, freq_minutes=10) and not due(49)  # ten minutes since the last checkpoint; steps alone: not yet
    assert not due(49, freq_minutes=10, saved_at=now[0] - 1)  # counted from the last checkpoint, whatever made it
    assert not due(50, mode="disabled", freq_minutes=10)  # checkpoints off: never
