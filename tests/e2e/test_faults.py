"""Faults end in one line and lose nothing (issue 29), each driven through the real command:

- a trial lock: a second run into a trial in use is refused (two real processes); a SIGKILLed holder's lock is stale;
- resource errors (a run root that is a file or read-only, a full disk during a checkpoint or a metrics write, a
  /dev/shm too small for the shared-memory weight sync), each in a small tmpfs in a private mount namespace;
- SIGTERM / SIGINT: a clean stop with a final checkpoint, ``summary.json`` status interrupted, exit 128 + signal, and
  a resume that logs exactly what an uninterrupted run logs;
- data that does not fit the run; every checkpoint corrupt; a torn last metrics line on extend; report figures.

Each case checks the console line, the exit code and what survived on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CPU_CONFIG, REPO, small_overrides
from stalerl.results.metrics_log import read_metrics

SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
TIMING_PREFIXES = ("timing/", "throughput/", "memory/")
EXP = "gsm8k-m2po-cpu"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), STALERL_STOP_GRACE_S="60")


def _cmd(args: list[str]) -> list[str]:
    return [sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *args]


def run_cli(args: list[str], timeout: float = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(args), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def stalerl_lines(stderr: str) -> list[str]:
    """stderr lines that are not the config-lookup note or Python logging of warnings we expect."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("stalerl: config ")]


def assert_one_line(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    lines = stalerl_lines(res.stderr)
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("stalerl: "), lines
    assert "Traceback" not in res.stderr + res.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES) and not k.startswith("warm_start/sec")}
            for r in rows]


def in_namespace(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``sh -c script`` in a private mount namespace (root only): its mounts vanish with it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.decode().strip()}")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], env=_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _q(args: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in args)


def _inspect_py(run: Path) -> str:
    """A python one-liner run inside the namespace: what survived in ``run`` as one JSON line on stdout."""
    code = f"""
import json, os
from stalerl.training.checkpoint import list_checkpoints, load_checkpoint
run = {str(run)!r}
out = {{"ckpts": [], "metrics_raw_ends_newline": None, "steps": None}}
for step, path in list_checkpoints(run):
    load_checkpoint(path)  # raises if damaged
    out["ckpts"].append(step)
m = os.path.join(run, "metrics.jsonl")
if os.path.exists(m):
    raw = open(m, "rb").read()
    out["metrics_raw_ends_newline"] = raw.endswith(b"\\n")
    out["steps"] = [json.loads(l)["step"] for l in raw.decode().splitlines()]  # every line parses
out["leftovers"] = sorted(n for n in os.listdir(os.path.join(run, "checkpoints")) if "tmp" in n) if \\
    os.path.isdir(os.path.join(run, "checkpoints")) else []
print("INSPECT " + json.dumps(out))
"""
    return _q([sys.executable, "-c", code])


def _inspected(res: subprocess.CompletedProcess) -> dict:
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("INSPECT "))
    return json.loads(line[len("INSPECT "):])


# ------------------------------------------------------------------------------------------------- the lock
def _wait_for_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            if len(read_metrics(run)) >= n:
                return
        except FileNotFoundError:
            pass
        assert time.time() < deadline, f"fewer than {n} metrics lines after {timeout:.0f}s"
        time.sleep(0.1)


@pytest.mark.slow
def test_second_run_into_a_held_trial_is_refused_and_a_killed_holders_lock_is_stale(tmp_path):
    common = small_overrides(tmp_path, **{"total_train_steps": 40, "recover.mode": "auto", "recover.freq_steps": 2,
                                          "trial_name": "locked"})
    run = tmp_path / "runs" / EXP / "locked"
    first = subprocess.Popen(_cmd(common), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        _wait_for_steps(run, 3, first)
        start = time.time()
        second = run_cli(common)
        line = assert_one_line(second, 2, f"trial {run} is in use by another run", f"pid {first.pid} on host",
                               "trial_name=locked-2")
        assert time.time() - start < 60 and "started 20" in line
        assert first.poll() is None  # the holder is untouched ...
        rows = read_metrics(run)
        steps = [r["step"] for r in rows]
        assert steps == list(range(len(steps)))  # ... and its metrics hold every step once
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (run / ".lock").exists()  # the file outlives its holder; the kernel released the lock itself
    third = run_cli(common)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed from checkpoint at step" in third.stdout
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == list(range(41))


# --------------------------------------------------------------------------------------------- resources
def test_run_root_that_is_a_file_is_refused_before_any_work(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("not a directory\n")
    res = run_cli([*small_overrides(tmp_path), f"cluster.fileroot={root}"])
    assert_one_line(res, 2, "cluster.fileroot=", "is a file, not a directory")
    assert root.read_text() == "not a directory\n"


def test_read_only_run_root_is_refused_before_any_work(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    res = in_namespace(f"mount -t tmpfs -o ro,size=1m tmpfs {root} && "
                       + _q(_cmd([*small_overrides(tmp_path), f"cluster.fileroot={root}"])))
    assert_one_line(res, 2, "cluster.fileroot=", "Read-only file system")


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "runs" / EXP / "full"
    # One checkpoint (model + AdamW state, ~7 MB) fits in 10 MB, a second one does not.
    args = small_overrides(tmp_path, **{"cluster.fileroot": disk / "runs", "trial_name": "full",
                                        "total_train_steps": 6, "recover.mode": "auto", "recover.freq_steps": 2,
                                        "saver.save_final": False})
    res = in_namespace(f"mount -t tmpfs -o size=10m tmpfs {disk} && {{ {_q(_cmd(args))}; echo EXIT=$?; }} && "
                       + _inspect_py(run))
    exit_code = int(next(ln for ln in res.stdout.splitlines() if ln.startswith("EXIT="))[5:])
    lines = stalerl_lines(res.stderr)
    assert exit_code == 2, res.stderr[-3000:]
    assert [ln for ln in lines if ln.startswith("stalerl: error:")] == lines[-1:], lines
    assert "could not write checkpoint step_4" in lines[-1] and "No space left on device" in lines[-1]
    assert "Traceback" not in res.stderr
    got = _inspected(res)
    assert got["ckpts"] == [2]  # the previous checkpoint loads (sha256 verified); no half-written one remains
    assert got["leftovers"] == []
    assert got["metrics_raw_ends_newline"] and got["steps"] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_disk_full_during_a_metrics_write_leaves_only_whole_lines(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "runs" / EXP / "full"
    args = small_overrides(tmp_path, **{"cluster.fileroot": disk / "runs", "trial_name": "full",
                                        "total_train_steps": 200, "saver.save_final": False})
    res = in_namespace(f"mount -t tmpfs -o size=40k tmpfs {disk} && {{ {_q(_cmd(args))}; echo EXIT=$?; }} && "
                       + _inspect_py(run))
    exit_code = int(next(ln for ln in res.stdout.splitlines() if ln.startswith("EXIT="))[5:])
    lines = stalerl_lines(res.stderr)
    assert exit_code == 2, res.stderr[-3000:]
    assert len(lines) == 1 and "could not write a metrics line" in lines[0] and "No space left" in lines[0], lines
    got = _inspected(res)
    assert got["metrics_raw_ends_newline"] is True  # no partial line: every line parsed in the namespace
    assert got["steps"] == list(range(len(got["steps"]))) and len(got["steps"]) >= 2


@pytest.mark.slow
def test_disk_full_during_a_tensorboard_write_is_the_same_one_line(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "runs" / EXP / "tb"
    events = run / "tensorboard"
    events.mkdir(parents=True)  # only TensorBoard's folder is on the small disk: metrics.jsonl has room
    args = small_overrides(tmp_path, **{"trial_name": "tb", "total_train_steps": 200, "stats_logger.tensorboard": True,
                                        "saver.save_final": False})
    res = in_namespace(f"mount -t tmpfs -o size=16k tmpfs {events} && {{ {_q(_cmd(args))}; echo EXIT=$?; }}")
    exit_code = int(next(ln for ln in res.stdout.splitlines() if ln.startswith("EXIT="))[5:])
    lines = stalerl_lines(res.stderr)
    assert exit_code == 2, res.stderr[-3000:]
    assert len(lines) == 1 and "could not write TensorBoard events" in lines[0] and "No space left" in lines[0], lines
    assert "Traceback" not in res.stderr
    raw = (run / "metrics.jsonl").read_bytes()
    steps = [json.loads(line)["step"] for line in raw.decode().splitlines()]  # every line whole
    assert raw.endswith(b"\n") and steps == list(range(len(steps))) and 1 < len(steps) < 200
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_dev_shm_too_small_for_shared_memory_weights_is_refused_and_leaves_no_segment(tmp_path):
    args = small_overrides(tmp_path, **{"rollout.fixed_staleness": 0, "rollout.max_head_offpolicyness": 2})
    res = in_namespace("mount -t tmpfs -o size=1m tmpfs /dev/shm && { " + _q(_cmd(args))
                       + "; echo EXIT=$?; } && echo SHM=$(ls -A /dev/shm | tr '\\n' ' ')")
    exit_code = int(next(ln for ln in res.stdout.splitlines() if ln.startswith("EXIT="))[5:])
    shm = next(ln for ln in res.stdout.splitlines() if ln.startswith("SHM="))[4:].split()
    assert exit_code == 2, res.stderr[-3000:]
    line = stalerl_lines(res.stderr)
    assert len(line) == 1 and "/dev/shm" in line[0] and "rollout.weight_sync=disk" in line[0], line
    assert not [n for n in shm if n.startswith("torch_")], shm
    assert "warm start" not in res.stdout  # refused before any work


# ----------------------------------------------------------------------------------------------- signals
def _signal_after_steps(args: list[str], run: Path, steps: int, sig: int, *, group: bool = False):
    proc = subprocess.Popen(_cmd(args), cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=group)
    try:
        _wait_for_steps(run, steps + 1, proc)  # + the step-0 line
        (os.killpg if group else os.kill)(proc.pid, sig)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _assert_interrupted(res, run: Path, sig: int) -> dict:
    name = signal.Signals(sig).name
    line = assert_one_line(res, 128 + sig, f"interrupted by {name} at step", "final checkpoint of step")
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted"]["signal"] == name, s
    step = s["interrupted"]["checkpoint_step"]
    assert f"step {step}" in line and (run / "checkpoints" / f"step_{step}").is_dir()
    assert [r["step"] for r in read_metrics(run)] == list(range(step + 1))
    assert not (run / "finished.json").exists()
    return s


@pytest.mark.slow
def test_sigterm_stops_a_sync_run_cleanly_and_resume_logs_the_same_metrics(tmp_path):
    common = small_overrides(tmp_path, **{"total_train_steps": 10, "recover.mode": "auto", "recover.freq_steps": 4,
                                          "rollout.fixed_staleness": 1, "evaluator.freq_steps": 5})
    reference = run_cli([*common, "trial_name=uninterrupted"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "runs" / EXP / "stopped"
    res = _signal_after_steps([*common, "trial_name=stopped"], run, 2, signal.SIGTERM)
    s = _assert_interrupted(res, run, signal.SIGTERM)
    assert s["interrupted"]["checkpoint_step"] < 10
    resumed = run_cli([*common, "trial_name=stopped"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint at step {s['interrupted']['checkpoint_step']}" in resumed.stdout
    assert _comparable(read_metrics(run)) == _comparable(read_metrics(tmp_path / "runs" / EXP / "uninterrupted"))


@pytest.mark.slow
def test_ctrl_c_to_an_async_run_is_an_interruption_not_a_worker_failure(tmp_path):
    args = small_overrides(tmp_path, **{"total_train_steps": 40, "recover.mode": "auto", "recover.freq_steps": 50,
                                        "rollout.fixed_staleness": 0, "rollout.max_head_offpolicyness": 2,
                                        "trial_name": "ctrl-c"})
    run = tmp_path / "runs" / EXP / "ctrl-c"
    # A terminal's Ctrl-C reaches the whole process group: the controller and its worker processes.
    res = _signal_after_steps(args, run, 2, signal.SIGINT, group=True)
    _assert_interrupted(res, run, signal.SIGINT)
    assert "worker" not in res.stderr and "KeyboardInterrupt" not in res.stderr
    for log in (run / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log
    # every worker is gone (none of them outlives the controller)
    leftover = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout.split()
    assert not leftover, leftover


@pytest.mark.slow
def test_sigterm_during_the_warm_start_stops_at_once_with_a_summary(tmp_path):
    args = small_overrides(tmp_path, **{"warm_start.steps": 5000, "recover.mode": "auto", "trial_name": "early"})
    run = tmp_path / "runs" / EXP / "early"
    proc = subprocess.Popen(_cmd(args), cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 300
        while not (run / "config.yaml").exists():
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        time.sleep(5)  # loading the model, or inside the warm start (5000 steps): either way before any step
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_one_line(res, 143, "interrupted by SIGTERM", "no final checkpoint")
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted"]["checkpoint_step"] is None


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_signal_to_a_local_sweep_stops_its_run_cleanly_and_starts_no_other(tmp_path, sig, group):
    """SIGTERM to the sweep's process (passed on to the run in progress) or Ctrl-C to the group (both get it)."""
    name = signal.Signals(sig).name
    common = small_overrides(tmp_path, **{"total_train_steps": 10, "recover.mode": "auto", "recover.freq_steps": 50,
                                          "rollout.fixed_staleness": 1, "trial_name": "sw"})
    runs = tmp_path / "runs" / EXP
    first, second = runs / "sw-loss=m2po", runs / "sw-loss=vanilla"
    res = _signal_after_steps([*common, "actor.loss=m2po,vanilla"], first, 2, sig, group=group)
    s = _assert_interrupted(res, first, sig)  # the run's own line is the sweep's one line
    assert not second.exists()  # not started after the signal
    table = (runs / "sweep_summary.md").read_text()
    assert f"interrupted ({name})" in table and "not run (interrupted)" in table, table
    leftover = subprocess.run(["pgrep", "-f", str(runs)], capture_output=True, text=True).stdout.split()
    assert not leftover, leftover
    # the same sweep command again: the interrupted run resumes from its final checkpoint, the other one runs
    again = run_cli([*common, "actor.loss=m2po,vanilla"])
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"resumed from checkpoint at step {s['interrupted']['checkpoint_step']}" in again.stdout
    for run in (first, second):
        assert [r["step"] for r in read_metrics(run)] == list(range(11))
        assert json.loads((run / "summary.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_sigterm_during_the_final_checkpoint_lets_the_run_finish_with_its_marker(tmp_path):
    # the final save pauses (a test hook) with its checkpoint written but not yet in place; SIGTERM lands there
    args = small_overrides(tmp_path, **{"total_train_steps": 4, "recover.mode": "auto", "recover.freq_steps": 50,
                                        "trial_name": "last"})
    run = tmp_path / "runs" / EXP / "last"
    env = {**_env(), "STALERL_TEST_CHECKPOINT_PAUSE_S": "3", "STALERL_STOP_GRACE_S": "1"}
    proc = subprocess.Popen(_cmd(args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list((run / "checkpoints").glob("step_4.tmp-*")):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # the pause (3 s) outlasts the grace (1 s): no cut either
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert not stalerl_lines(err), err[-3000:]
    assert "SIGTERM received after the last step: finishing the run's final save" in out
    assert json.loads((run / "finished.json").read_text())["step"] == 4
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_4"
    from stalerl.training.checkpoint import load_latest_checkpoint

    assert load_latest_checkpoint(run)[0] == 4  # the sha256 of step 4 checks out
    assert not list((run / "checkpoints").glob("*.tmp-*"))
    assert [r["step"] for r in read_metrics(run)] == list(range(5))


# -------------------------------------------------------------------------------------------- data fits
def _gsm8k_file(path: Path, rows: int, distinct: int) -> Path:
    with open(path, "w") as fh:
        for i in range(rows):
            j = i % distinct
            fh.write(json.dumps({"question": f"What is {j} plus {j}?", "answer": f"{j}+{j}={2 * j}\n#### {2 * j}"})
                     + "\n")
    return path


@pytest.mark.parametrize("distinct, eval_problems, needles", [
    (80, 256, ["warm_start.eval_problems=256 holds out all 80 training examples", "train_dataset.path=",
               "warm_start.target_accuracy=0"]),
    (8, 16, ["warm_start.eval_problems=16", "8 distinct questions in 80 rows", "remove the duplicate rows"]),
])
def test_a_small_real_dataset_that_does_not_fit_is_one_line_before_any_work(tmp_path, distinct, eval_problems,
                                                                            needles):
    data = _gsm8k_file(tmp_path / "small.jsonl", 80, distinct)
    res = run_cli([*small_overrides(tmp_path, **{"train_dataset.path": data, "valid_dataset.path": data,
                                                 "warm_start.target_accuracy": 0.25,
                                                 "warm_start.eval_problems": eval_problems})])
    line = assert_one_line(res, 2, "the data does not fit this run", *needles)
    assert "synthetic" not in line  # the keys for real data, not the generator's
    assert "warm start" not in res.stdout and not list(tmp_path.rglob("metrics.jsonl"))


def test_batch_and_evaluation_larger_than_the_data_are_one_line(tmp_path):
    data = _gsm8k_file(tmp_path / "small.jsonl", 20, 20)
    res = run_cli([*small_overrides(tmp_path, **{"train_dataset.path": data, "valid_dataset.path": data,
                                                 "train_dataset.batch_size": 32, "evaluator.n_prompts": 64})])
    assert_one_line(res, 2, "train_dataset.batch_size=32 exceeds the 20 training examples",
                    "evaluator.n_prompts=64 but valid_dataset.path=")


# ----------------------------------------------------------------------- checkpoints, extension, report
@pytest.fixture(scope="module")
def finished_trial(tmp_path_factory):
    """A finished 4-step trial with checkpoints at steps 2 and 4 (copied by each test that damages it)."""
    tmp = tmp_path_factory.mktemp("finished")
    res = run_cli(small_overrides(tmp, **{"total_train_steps": 4, "recover.mode": "auto", "recover.freq_steps": 2,
                                          "trial_name": "done", "saver.save_final": False}))
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "runs" / EXP / "done"


def _copy_trial(src: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    run = tmp_path / "runs" / EXP / "done"
    shutil.copytree(src, run)
    return run, small_overrides(tmp_path, **{"recover.mode": "auto", "recover.freq_steps": 2, "trial_name": "done",
                                             "saver.save_final": False})


@pytest.mark.slow
def test_every_checkpoint_corrupt_is_refused_naming_them_and_they_are_kept(finished_trial, tmp_path):
    run, args = _copy_trial(finished_trial, tmp_path)
    states = sorted((run / "checkpoints").glob("step_*/state.pt"))
    assert [p.parent.name for p in states] == ["step_2", "step_4"]
    for p in states:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in states}
    res = run_cli([*args, "total_train_steps=6"])
    assert_one_line(res, 2, "every checkpoint of", "step_4: sha256 mismatch", "step_2: sha256 mismatch",
                    "recover.mode=disabled")
    assert {p: p.read_bytes() for p in states} == before  # nothing deleted, nothing changed
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_torn_last_metrics_line_is_restored_from_the_checkpoint_on_extend(finished_trial, tmp_path):
    run, args = _copy_trial(finished_trial, tmp_path)
    text = (run / "metrics.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    original_last = lines[-1]
    assert json.loads(original_last)["step"] == 4
    (run / "metrics.jsonl").write_text("".join(lines[:-1]) + original_last[: len(original_last) // 2])  # torn
    res = run_cli([*args, "total_train_steps=6"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no intact line for step 4 (torn); restored it from the checkpoint of step 4" in res.stdout
    after = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(ln)["step"] for ln in after] == [0, 1, 2, 3, 4, 5, 6]
    assert after[4] == original_last  # byte for byte what the finished run had written


@pytest.mark.slow
def test_report_of_a_run_directory_writes_figures_to_the_current_directory(finished_trial, tmp_path):
    pytest.importorskip("matplotlib")
    before = sorted(p.name for p in finished_trial.iterdir())
    cwd = tmp_path / "here"
    cwd.mkdir()
    res = subprocess.run([sys.executable, "-m", "stalerl_study.report", str(finished_trial)], cwd=cwd, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in finished_trial.iterdir()) == before  # nothing written into the run folder
    figures = sorted(cwd.glob("*.png"))
    assert figures and all(f"figure: {f}" in res.stdout for f in figures)
