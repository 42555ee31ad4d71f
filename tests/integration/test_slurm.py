"""scheduler.type=slurm: the sbatch script (rendering, quoting, injection), and real submissions to a single-node
Slurm cluster started by the ``slurm_cluster`` fixture (tests/integration/slurm_cluster.py).

The first group needs no cluster. The ``slurm`` group submits for real: a few training steps with the inner scheduler
local, then ray (async d1+d1), a 2x2 sweep as a job array through the CLI, a job that fails at run time, and a
submission sbatch rejects. Without Slurm (binaries missing, not root, daemons not starting) they skip with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CPU_CONFIG, REPO
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)
from stalerl.config import ConfigError, load_config, run_dir
from stalerl.schedulers import slurm

LAUNCH_TIME_ENV = slurm.LAUNCH_TIME_ENV


def tiny_overrides(tmp_path: Path, **extra) -> list[str]:
    """The embedded default shrunk to a few seconds: 3 steps, 10 warm-start steps, one thread."""
    base = {
        "cluster.fileroot": str(tmp_path / "runs"),
        "total_train_steps": 3,
        "warm_start.steps": 10,
        "warm_start.batch_size": 16,
        "warm_start.target_accuracy": 0,
        "train_dataset.batch_size": 8,
        "train_dataset.synthetic.train_size": 200,
        "evaluator.n_prompts": 16,
        "evaluator.freq_steps": 3,
        "valid_dataset.batch_size": 16,
        "torch_threads": 1,
        "stats_logger.progress_bar": False,
        "stats_logger.tensorboard": False,
        "recover.mode": "disabled",
        "saver.save_final": False,
        "scheduler.type": "slurm",
        "scheduler.slurm.mem": "1G",
        "scheduler.slurm.cpus_per_task": 1,
        "scheduler.slurm.time": "00:10:00",
        "scheduler.slurm.poll_interval_s": 0.2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def tiny_cfg(tmp_path: Path, **extra):
    return load_config(["--config", str(CPU_CONFIG), *tiny_overrides(tmp_path, **extra)])


# Each payload tries to run `touch <marker>` if it is ever interpreted by a shell (or ends an #SBATCH line early).
PAYLOADS = [
    "'; touch {m} #",
    "$(touch {m})",
    "`touch {m}`",
    "x\" ; touch {m} ; echo \"",
    "a b'\"$(touch {m})`touch {m}`\\;#%j%%&|>",
]


def payloads(marker: str) -> list[str]:
    return [p.format(m=marker) for p in PAYLOADS]


def pathsafe(text: str) -> str:
    """A payload usable in a directory name (experiment_name refuses '/' and '\\')."""
    return text.replace("/", "_").replace("\\", "_")


def recorder(path: Path, record: Path) -> Path:
    """A stand-in for the job's Python: writes its argv, NUL-separated, to ``record``; exits 0."""
    path.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" >> {record}\nprintf '\\n' >> {record}\n")
    path.chmod(0o755)
    return path


def recorded(record: Path) -> list[list[str]]:
    calls = [c for c in record.read_text().split("\0\n") if c] if record.exists() else []
    return [c.split("\0") for c in calls]


def no_markers(*dirs: Path) -> list[Path]:
    return [p for d in dirs for p in d.rglob("pwned")]


def bash_n(script: str, tmp_path: Path) -> None:
    f = tmp_path / "check.sbatch"
    f.write_text(script)
    res = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def parse_sbatch_line(line: str) -> list[str]:
    """The arguments sbatch reads from one #SBATCH line (a transcription of sbatch's _get_argument loop)."""
    args, i, s = [], len("#SBATCH"), line
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if i >= len(s):
            return args
        arg, quoted, q, esc = [], False, "", False
        while i < len(s) and (quoted or not s[i].isspace()):
            c = s[i]
            if esc:
                esc = False
            elif c == "\\":
                esc, i = True, i + 1
                continue
            elif quoted:
                if c == q:
                    quoted, i = False, i + 1
                    continue
            elif c in "\"'":
                quoted, q, i = True, c, i + 1
                continue
            elif c == "#":
                return args + (["".join(arg)] if arg else [])
            arg.append(c)
            i += 1
        args.append("".join(arg))


# ================================================================================================ no cluster needed
def test_render_single_job_ray(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.nodes": 2, "scheduler.slurm.gpus_per_node": 4,
                                "scheduler.slurm.cpus_per_task": 8, "scheduler.slurm.mem": "64G",
                                "scheduler.slurm.partition": "gpu,debug", "scheduler.slurm.account": "proj-1",
                                "scheduler.slurm.extra_sbatch_args": "[--qos=high,--exclusive]"})
    argv = slurm.inner_command(cfg, tmp_path / "c.yaml")
    assert argv[:3] == [sys.executable, "-m", "stalerl.launch.cli"] and argv[-1] == "scheduler.type=ray"
    script = slurm.render_sbatch(cfg, inner_argv=argv, job_name="exp-trial", log_dir=tmp_path / "logs")
    bash_n(script, tmp_path)
    lines = sbatch_lines(script)
    for want in ("--job-name=exp-trial", f"--output={tmp_path}/logs/%j.log", f"--error={tmp_path}/logs/%j.log",
                 "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem=64G", "--time=00:10:00",
                 "--gres=gpu:4", "--partition=gpu,debug", "--account=proj-1", "--qos=high", "--exclusive"):
        assert f"#SBATCH {want}" in lines, (want, lines)
    assert script.startswith("#!/bin/bash\n#SBATCH") and "set -euo pipefail" in script
    assert "ray.scripts.scripts start --head --block" in script and "--num-gpus=4" in script
    assert '--num-cpus="${SLURM_CPUS_PER_TASK:-1}"' in script
    assert "--disable-usage-stats --include-dashboard=false" in script
    assert '--exclude="$head_node"' in script and 'srun --nodes="$((n_nodes - 1))"' in script
    assert 'cmd+=("scheduler.ray_address=$ray_address")' in script
    code = [line.split("#", 1)[0] for line in script.splitlines() if not line.startswith("#")]
    assert not any(re.search(r"\b(ray|scripts) stop\b", c) for c in code)  # only this job's Ray is stopped
    assert 'exit "$rc"' in script


def test_render_local_inner_and_array(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.max_parallel": 2})
    single = slurm.render_sbatch(cfg, inner_argv=slurm.inner_command(cfg, tmp_path / "c.yaml", inner="local"),
                                 job_name="j", log_dir=tmp_path, inner_scheduler="local")
    bash_n(single, tmp_path)
    assert "ray.scripts" not in single and "--gres" not in single and "--partition" not in single
    array = slurm.render_sbatch(cfg, inner_argv=slurm.inner_command(cfg, None, array=True), job_name="j",
                                log_dir=tmp_path / "l", array_size=4, runs_file=tmp_path / "runs.txt")
    bash_n(array, tmp_path)
    assert "#SBATCH --array=0-3%2" in sbatch_lines(array)
    assert f"#SBATCH --output={tmp_path}/l/%A_%a.log" in sbatch_lines(array)
    assert "scheduler.type=local" in array and "ray.scripts" not in array  # arrays default to local
    assert 'cmd+=(--config "$run_config")' in array
    with pytest.raises(ConfigError, match="scheduler.slurm.nodes"):
        slurm.render_sbatch(tiny_cfg(tmp_path, **{"scheduler.slurm.nodes": 2}), inner_argv=["py"], job_name="j",
                            log_dir=tmp_path, inner_scheduler="local")


@pytest.mark.parametrize("key", ["partition", "account"])
def test_injection_in_validated_names_is_rejected(tmp_path, key):
    for payload in payloads("pwned"):
        with pytest.raises(ConfigError) as exc:
            tiny_cfg(tmp_path, **{f"scheduler.slurm.{key}": payload})
        assert f"scheduler.slurm.{key}" in str(exc.value)
        cfg = tiny_cfg(tmp_path)
        setattr(cfg.scheduler.slurm, key, payload)  # bypassing load-time checks: render still refuses
        with pytest.raises(ConfigError) as exc:
            slurm.render_sbatch(cfg, inner_argv=["py"], job_name="j", log_dir=tmp_path)
        assert f"scheduler.slurm.{key}" in exc.value.keys


@pytest.mark.parametrize("bad", ["a\nb", "a\x00b", "a\rb", "x\n#SBATCH --wrap=touch pwned"])
def test_newlines_and_nul_rejected_naming_the_key(tmp_path, bad):
    for key in ("partition", "account", "time", "mem", "python"):
        cfg = tiny_cfg(tmp_path)
        setattr(cfg.scheduler.slurm, key, bad)
        with pytest.raises(ConfigError) as exc:
            slurm.render_sbatch(cfg, inner_argv=["py"], job_name="j", log_dir=tmp_path)
        assert f"scheduler.slurm.{key}" in str(exc.value) and ("newline" in str(exc.value) or "NUL" in
                                                                 str(exc.value) or "carriage" in str(exc.value))
    cfg = tiny_cfg(tmp_path)
    cfg.scheduler.slurm.extra_sbatch_args = ["--comment=" + bad]
    with pytest.raises(ConfigError, match=re.escape("scheduler.slurm.extra_sbatch_args[0]")):
        slurm.render_sbatch(cfg, inner_argv=["py"], job_name="j", log_dir=tmp_path)
    for kw in ({"job_name": bad}, {"log_dir": tmp_path / bad}, {"inner_argv": ["py", bad]},
               {"array_size": 2, "runs_file": tmp_path / bad}):
        args = dict(inner_argv=["py"], job_name="j", log_dir=tmp_path)
        args.update(kw)
        with pytest.raises(ConfigError) as exc:
            slurm.render_sbatch(tiny_cfg(tmp_path), **args)
        assert exc.value.keys, exc.value
    for key in ("experiment_name", "trial_name", "cluster.fileroot"):
        cfg = tiny_cfg(tmp_path)
        section, _, name = key.rpartition(".")
        setattr(cfg.cluster if section else cfg, name, bad)
        with pytest.raises(ConfigError) as exc:
            slurm.launch_slurm(cfg, None, [], dry_run=True)
        assert key in str(exc.value)
    with pytest.raises(ConfigError, match="scheduler.slurm.partition"):  # also at load time
        load_config(["scheduler.slurm.partition=a\nb"])


def test_extra_sbatch_args_validated(tmp_path):
    for bad, why in (("-q high", "long option"), ("--output=/tmp/x", "set by the slurm scheduler"),
                     ("--array=0-3", "set by the slurm scheduler"), ("--job-name=x", "set by the slurm scheduler"),
                     ("qos=high", "long option")):
        with pytest.raises(ConfigError, match=why) as exc:
            tiny_cfg(tmp_path, **{"scheduler.slurm.extra_sbatch_args": f"['{bad}']"})
        assert "scheduler.slurm.extra_sbatch_args[0]" in str(exc.value)
    cfg = tiny_cfg(tmp_path)
    cfg.scheduler.slurm.extra_sbatch_args = [f"--comment={p}" for p in payloads("pwned")]
    script = slurm.render_sbatch(cfg, inner_argv=["py"], job_name="j", log_dir=tmp_path)
    bash_n(script, tmp_path)
    parsed = [parse_sbatch_line(line) for line in sbatch_lines(script) if line.startswith("#SBATCH --comment")]
    assert parsed == [[f"--comment={p}"] for p in payloads("pwned")]  # one argument each, exactly the value


def test_sbatch_quote_roundtrip():
    for value in ["plain-1.0:/x", "", "a b", "#x", "a'b", 'a"b', "a\\b", "%j %%", *payloads("/tmp/pwned")]:
        assert parse_sbatch_line("#SBATCH --x=" + slurm.sbatch_quote(value)) == ["--x=" + value]
    with pytest.raises(ValueError):
        slurm.sbatch_quote("a\nb")


def _sandbox_env(tmp_path: Path, **extra) -> dict:
    """Run a rendered script with plain bash, as Slurm would start it (no Slurm involved)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "localhost",
                "PATH": os.environ["PATH"]}, **extra)
    return env


def test_injection_never_executes_single_job_sandbox(tmp_path, monkeypatch):
    """Payloads in job name, experiment name, fileroot (so in every path), extra args and the python path: the
    rendered script passes bash -n, runs, and hands every value verbatim to the inner command; no marker appears."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    record = tmp_path / "argv.rec"
    for i, p in enumerate(payloads("pwned")):
        root = tmp_path / f"root{i} {pathsafe(p)}"
        py_dir = tmp_path / f"py{i} {pathsafe(p)}"
        py_dir.mkdir(parents=True)
        py = recorder(py_dir / "python", record)
        cfg = tiny_cfg(tmp_path, **{"cluster.fileroot": str(root), "experiment_name": pathsafe(p),
                                    "scheduler.slurm.inner_scheduler": "local", "scheduler.slurm.python": str(py)})
        cfg.scheduler.slurm.extra_sbatch_args = [f"--comment={p}"]
        cfg.trial_name = pathsafe(p)
        assert slurm.launch_slurm(cfg, None, [], dry_run=True) == 0
        slurm_dir = run_dir(cfg) / "slurm"
        script_path = slurm_dir / "job.sbatch"
        script = script_path.read_text()
        bash_n(script, tmp_path)
        direct = slurm.render_sbatch(cfg, inner_argv=[str(py), "-m", "stalerl.launch.cli", "--config", p, f"x={p}"],
                                     job_name=p, log_dir=slurm_dir / "logs", inner_scheduler="local")
        for text in (script, direct):
            record.unlink(missing_ok=True)
            f = tmp_path / "s.sbatch"
            f.write_text(text)
            res = subprocess.run(["bash", str(f)], cwd=work, env=_sandbox_env(tmp_path), capture_output=True,
                                 text=True, timeout=60)
            assert res.returncode == 0, res.stdout + res.stderr
            calls = recorded(record)
            assert len(calls) == 1, calls
            if text is script:
                assert calls[0] == ["-m", "stalerl.launch.cli", "--config", str(slurm_dir / "config.yaml"),
                                    "scheduler.type=local"]
                assert load_config(["--config", calls[0][3]]).experiment_name == pathsafe(p)
            else:
                assert calls[0] == ["-m", "stalerl.launch.cli", "--config", p, f"x={p}"]
        job_name_line = next(line for line in sbatch_lines(direct) if line.startswith("#SBATCH --job-name"))
        assert parse_sbatch_line(job_name_line) == [f"--job-name={p}"]
        out_line = next(line for line in sbatch_lines(script) if line.startswith("#SBATCH --output"))
        assert parse_sbatch_line(out_line) == [
            "--output=" + str(slurm_dir / "logs").replace("%", "%%") + "/%j.log"]
    assert not no_markers(tmp_path, work), no_markers(tmp_path, work)


def test_injection_never_executes_array_sandbox(tmp_path, monkeypatch, capsys):
    """A sweep's job array: payloads in experiment name, fileroot and swept override values end up in the per-run
    config files and their paths (runs file); each array task passes its path verbatim."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    record = tmp_path / "argv.rec"
    p = payloads("pwned")[-1]
    root = tmp_path / f"root {pathsafe(p)}"
    py = recorder(tmp_path / "python", record)
    values = [pathsafe(v).replace(",", "_") for v in payloads("pwned")[:2]]
    runs = [(f"t{i}", [f"train_dataset.path={v}", f"trial_name=t{i}-{v}"]) for i, v in enumerate(values)]
    configs = [tiny_cfg(tmp_path, **{"cluster.fileroot": str(root), "experiment_name": pathsafe(p),
                                     "scheduler.slurm.python": str(py)}) for _ in runs]
    for cfg, (_, ovr) in zip(configs, runs):
        cfg.train_dataset.path = ovr[0].split("=", 1)[1]
        cfg.trial_name = ovr[1].split("=", 1)[1]
    statuses = slurm.run_sweep_slurm(None, runs, configs, dry_run=True)
    assert statuses == ["dry-run", "dry-run"]
    script_path = next((run_dir(configs[0]).parent / "slurm-sweeps").glob("*/job.sbatch"))
    script = script_path.read_text()
    assert script in capsys.readouterr().out
    bash_n(script, tmp_path)
    for task, cfg in enumerate(configs):
        record.unlink(missing_ok=True)
        res = subprocess.run(["bash", str(script_path)], cwd=work, capture_output=True, text=True, timeout=60,
                             env=_sandbox_env(tmp_path, SLURM_ARRAY_TASK_ID=str(task)))
        assert res.returncode == 0, res.stdout + res.stderr
        (call,) = recorded(record)
        assert call[:3] == ["-m", "stalerl.launch.cli", "scheduler.type=local"] and call[3] == "--config"
        loaded = load_config(["--config", call[4]])
        assert loaded.train_dataset.path == cfg.train_dataset.path and loaded.trial_name == cfg.trial_name
    res = subprocess.run(["bash", str(script_path)], cwd=work, capture_output=True, text=True, timeout=60,
                         env=_sandbox_env(tmp_path, SLURM_ARRAY_TASK_ID="7"))
    assert res.returncode == 2 and "no run for array task 7" in res.stdout + res.stderr
    assert not no_markers(tmp_path, work)


def test_dry_run_prints_script_and_submits_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch reachable: a dry run must not need it
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.partition": "debug"})
    assert slurm.launch_slurm(cfg, str(CPU_CONFIG), [], dry_run=True) == 0
    out = capsys.readouterr().out
    d = run_dir(cfg) / "slurm"
    script = (d / "job.sbatch").read_text()
    assert out.startswith("#!/bin/bash\n#SBATCH") and script in out and "dry run: wrote" in out
    assert "#SBATCH --partition=debug" in script and str(d / "config.yaml") in script
    assert load_config(["--config", str(d / "config.yaml")]).scheduler.type == "slurm"
    assert not (d / "job.json").exists()
    cfg.scheduler.slurm.dry_run = True  # the config key does the same
    assert slurm.launch_slurm(cfg, None, [], dry_run=False) == 0


def test_sweep_refuses_differing_slurm_settings(tmp_path):
    a, b = tiny_cfg(tmp_path), tiny_cfg(tmp_path, **{"scheduler.slurm.mem": "2G"})
    with pytest.raises(ConfigError, match="scheduler.slurm.mem"):
        slurm.run_sweep_slurm(None, [("a", []), ("b", [])], [a, b], dry_run=True)


def test_scontrol_parsing():
    text = ("JobId=7 ArrayJobId=5 ArrayTaskId=2 JobName=a b JobState=COMPLETED UserId=root(0) GroupId=root(0) "
            "MCS_label=N/A Priority=1 Nice=0 Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode "
            "Dependency=(null) ExitCode=3:0 RunTime=00:00:01 WorkDir=/x y StdOut=/a JobState=COMPLETED.log\n"
            "JobId=5 ArrayJobId=5 ArrayTaskId=3-4%2 JobName=n UserId=root(0) GroupId=root(0) JobState=PENDING "
            "Reason=None ExitCode=0:0\n")
    a, b = slurm._parse_scontrol(text)
    assert (a.job_id, a.state, a.exit_code, a.signal, a.reason) == ("5_2", "FAILED", 3, 0, "NonZeroExitCode")
    assert (b.job_id, b.state, b.array_task) == ("5_3-4%2", "PENDING", "3-4%2")
    assert slurm._expand_tasks("3-4%2") == [3, 4] and slurm._expand_tasks("1,5-6") == [1, 5, 6]


# ================================================================================================ real Slurm
def _wait_state(job_id: str, timeout: float = 60.0):
    return slurm.wait_for_job(job_id, poll_s=0.2, timeout_s=timeout)


@pytest.mark.slurm
def test_slurm_rejected_submission_reports_sbatch_error(slurm_cluster, tmp_path):
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.partition": "nosuchpartition",
                                "scheduler.slurm.inner_scheduler": "local"})
    with pytest.raises(slurm.SlurmError, match="(?i)invalid partition"):
        slurm.launch_slurm(cfg, None, [])


@pytest.mark.slurm
def test_slurm_injection_never_executes_real_submission(slurm_cluster, tmp_path, monkeypatch, capsys):
    """The same payloads through a real sbatch/slurmd: job name, log directory, comment, config path and experiment
    name arrive verbatim; the log lands at the exact path; no marker file appears."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    record = tmp_path / "argv.rec"
    py = recorder(tmp_path / "python", record)
    p = payloads("pwned")[-1]
    cfg = tiny_cfg(tmp_path, **{"cluster.fileroot": str(tmp_path / f"root {pathsafe(p)}"),
                                "experiment_name": pathsafe(p), "scheduler.slurm.inner_scheduler": "local",
                                "scheduler.slurm.python": str(py)})
    cfg.scheduler.slurm.extra_sbatch_args = [f"--comment={p}"]
    assert slurm.launch_slurm(cfg, None, []) == 0
    (call,) = recorded(record)
    slurm_dir = run_dir(cfg) / "slurm"
    assert call == ["-m", "stalerl.launch.cli", "--config", str(slurm_dir / "config.yaml"), "scheduler.type=local"]
    job = json.loads((slurm_dir / "job.json").read_text())
    assert Path(job["log"]).is_file() and Path(job["log"]).parent == slurm_dir / "logs"
    info = subprocess.run(["scontrol", "show", "job", "-o", job["job_id"]], capture_output=True, text=True).stdout
    assert f"Comment={p}" in info
    # a job name with every payload, submitted directly
    names = []
    for q in payloads("pwned"):
        record.unlink(missing_ok=True)
        log_dir = tmp_path / f"logs {pathsafe(q)}"
        log_dir.mkdir()
        script = slurm.render_sbatch(cfg, inner_argv=[str(py), q], job_name=q, log_dir=log_dir,
                                     inner_scheduler="local")
        f = tmp_path / "direct.sbatch"
        f.write_text(script)
        job_id = slurm.submit(f)
        assert _wait_state(job_id) == ("COMPLETED", 0)
        assert (log_dir / f"{job_id}.log").is_file()
        assert recorded(record) == [[q]]
        names.append(re.search(r"JobName=(.*) UserId=", subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout).group(1))
    assert names == payloads("pwned")
    assert not no_markers(tmp_path, work, slurm_cluster.state)


def _report(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n    {text}")


def _startup(out: str) -> tuple[float, float]:
    m = re.search(r"first training step logged ([\d.]+)s after submission; start-up overhead before the first "
                  r"step ([\d.]+)s", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_trains_with_inner_local(slurm_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(LAUNCH_TIME_ENV, raising=False)
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.inner_scheduler": "local"})
    t0 = time.monotonic()
    rc = slurm.launch_slurm(cfg, str(CPU_CONFIG), [])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"submitted job \d+ .* log: .*/slurm/logs/\d+\.log", out)
    assert "COMPLETED" in out
    rows = [json.loads(line) for line in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    first, overhead = _startup(out)
    _report(capsys, f"slurm (inner local): {time.monotonic() - t0:.1f}s total, first step {first:.1f}s after "
                    f"submission, start-up overhead {overhead:.1f}s")


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_trains_with_inner_ray_async(slurm_cluster, tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.delenv(LAUNCH_TIME_ENV, raising=False)
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.inner_scheduler": "ray", "scheduler.slurm.cpus_per_task": 2,
                                "rollout.max_head_offpolicyness": 1, "rollout.fixed_staleness": 0,
                                "rollout.backend": "hf:d1", "actor.backend": "torch:d1"})
    t0 = time.monotonic()
    rc = slurm.launch_slurm(cfg, str(CPU_CONFIG), [])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ray head up at" in out and "scheduler.ray_address=" in out and "ray stopped" in out
    assert "Connected to Ray cluster" in out and "1 rollout + 1 train workers up" in out  # async, Ray actors
    rows = [json.loads(line) for line in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert max(r.get("staleness/max", 0) for r in rows) <= 1
    first, overhead = _startup(out)
    _report(capsys, f"slurm (inner ray, async d1+d1): {time.monotonic() - t0:.1f}s total, first step {first:.1f}s "
                    f"after submission, start-up overhead {overhead:.1f}s")


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_sweep_2x2_job_array_via_cli(slurm_cluster, tmp_path, capsys, monkeypatch):
    from stalerl.launch.cli import main

    monkeypatch.setenv(LAUNCH_TIME_ENV, repr(time.time()))  # cli.main would set it for the whole test session
    t0 = time.monotonic()
    rc = main(["--config", str(CPU_CONFIG), *tiny_overrides(tmp_path), "trial_name=sw",
               "actor.loss=m2po,vanilla", "rollout.fixed_staleness=0,1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"submitted job array \d+ \(4 tasks", out)
    summary = Path(tmp_path / "runs" / "gsm8k-m2po-cpu" / "sweep_summary.md").read_text()
    rows = [line for line in summary.splitlines()[2:] if line.strip()]
    assert len(rows) == 4 and all("| ok |" in r for r in rows), summary
    for loss in ("m2po", "vanilla"):
        for s in (0, 1):
            assert f"sw-loss={loss}-fixed_staleness={s}" in summary
    _report(capsys, f"slurm 2x2 sweep (job array, 1 CPU per task, 2 at once): {time.monotonic() - t0:.1f}s")


@pytest.mark.slurm
def test_slurm_failed_job_reported_with_state_and_log_tail(slurm_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(LAUNCH_TIME_ENV, raising=False)
    missing = tmp_path / "gone" / "train.jsonl"  # not checked at load time: the run fails inside the job
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.inner_scheduler": "local", "train_dataset.path": str(missing),
                                "scheduler.slurm.log_tail_lines": 15})
    rc = slurm.launch_slurm(cfg, None, [])
    captured = capsys.readouterr()
    assert rc != 0
    job = json.loads((run_dir(cfg) / "slurm" / "job.json").read_text())
    assert re.search(rf"job {job['job_id']} failed: FAILED \(exit code {rc}", captured.err), captured.err
    assert "last 15 lines of" in captured.err and str(missing) in captured.err.split("last 15 lines of", 1)[1]
    assert slurm.wait_for_job(job["job_id"], poll_s=0.2, timeout_s=10) == ("FAILED", rc)
    info = slurm.job_state(job["job_id"])
    assert info.state == "FAILED" and info.reason == "NonZeroExitCode"


@pytest.mark.ray
@pytest.mark.slow
def test_multi_node_ray_bootstrap_with_shimmed_slurm(tmp_path):
    """The nodes > 1 path of the script without a multi-node cluster: `scontrol show hostnames` reports two nodes and
    `srun` (a shim) starts the worker-side `ray start --address=... --block` on this machine. The script must bring up
    a 2-node Ray cluster, wait for both nodes, pass the head address to the run, and stop every Ray process it
    started."""
    pytest.importorskip("ray")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text("#!/bin/bash\n[ \"$1 $2\" = 'show hostnames' ] && printf 'nodeA\\nnodeB\\n'\n")
    srun_log = tmp_path / "srun.args"
    (shims / "srun").write_text("#!/bin/bash\nopts=()\nwhile [[ \"$1\" == --* ]]; do opts+=(\"$1\"); shift; done\n"
                                f"printf '%s\\n' \"${{opts[@]}}\" > {srun_log}\nexec \"$@\"\n")
    for f in shims.iterdir():
        f.chmod(0o755)
    record = tmp_path / "argv.rec"
    py = recorder(tmp_path / "run", record)
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.nodes": 2, "scheduler.slurm.inner_scheduler": "ray",
                                "scheduler.slurm.ray_start_timeout_s": 120})
    script = slurm.render_sbatch(cfg, inner_argv=[str(py), "train"], job_name="mn", log_dir=tmp_path,
                                 python=sys.executable)
    f = tmp_path / "mn.sbatch"
    f.write_text(script)
    env = _sandbox_env(tmp_path, SLURM_JOB_NODELIST="nodeA,nodeB", SLURM_CPUS_PER_TASK="1",
                       PATH=f"{shims}:{os.environ['PATH']}", STALERL_RAY_HEAD_IP="127.0.0.1")
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run(["bash", str(f)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out + (tmp_path / "ray-workers-42.log").read_text(errors="replace")[-3000:]
    assert "ray cluster: 2/2 nodes up" in out and "ray stopped" in out
    (call,) = recorded(record)
    assert call[0] == "train" and re.fullmatch(r"scheduler\.ray_address=[\w.:-]+:\d+", call[1]), call
    opts = srun_log.read_text().split()
    assert {"--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--exclude=nodeA"} <= set(opts), opts
    address = call[1].split("=", 1)[1]
    time.sleep(1)
    left = subprocess.run(["pgrep", "-af", f"gcs.address={address}"], capture_output=True, text=True).stdout
    assert not left.strip(), f"Ray processes of the job still running: {left}"


@pytest.mark.slurm
def test_slurm_job_exit_code_is_returned(slurm_cluster, tmp_path, capsys):
    """An inner command that exits 3: the job is FAILED with ExitCode 3 and launch returns 3."""
    fail = tmp_path / "python"
    fail.write_text("#!/bin/bash\necho 'about to fail with 3' >&2\nexit 3\n")
    fail.chmod(0o755)
    cfg = tiny_cfg(tmp_path, **{"scheduler.slurm.inner_scheduler": "local", "scheduler.slurm.python": str(fail)})
    assert slurm.launch_slurm(cfg, None, []) == 3
    err = capsys.readouterr().err
    assert "failed: FAILED (exit code 3" in err and "about to fail with 3" in err.split("last 40 lines of", 1)[1]


@pytest.mark.slurm
@pytest.mark.slow
def test_scancel_stops_the_run_cleanly_and_resubmitting_resumes_exactly(slurm_cluster, tmp_path, capsys, monkeypatch):
    """A real ``scancel``: Slurm sends SIGTERM to the job (its shell passes it on to the run too); the run stops at the
    end of its step with a final checkpoint and summary.json ``interrupted``; the same submission again resumes and
    logs what an uninterrupted run logs."""
    import threading

    from stalerl.results.metrics_log import read_metrics

    monkeypatch.delenv(LAUNCH_TIME_ENV, raising=False)
    over = {"scheduler.slurm.inner_scheduler": "local", "total_train_steps": 10, "recover.mode": "auto",
            "recover.freq_steps": 4, "rollout.fixed_staleness": 1, "evaluator.freq_steps": 5}
    reference = tiny_overrides(tmp_path, **{**over, "scheduler.type": "local", "trial_name": "uninterrupted"})
    res = subprocess.run([sys.executable, "-m", "stalerl.launch.cli", "--config", str(CPU_CONFIG), *reference],
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = tiny_cfg(tmp_path, **{**over, "trial_name": "cancelled"})
    run = run_dir(cfg)
    result: dict = {}
    follower = threading.Thread(target=lambda: result.update(rc=slurm.launch_slurm(cfg, str(CPU_CONFIG), [])))
    follower.start()
    deadline = time.time() + 300
    while True:  # two train steps logged (+ the step-0 line), then scancel
        assert follower.is_alive() and time.time() < deadline, capsys.readouterr()
        with contextlib.suppress(FileNotFoundError):
            if len(read_metrics(run)) >= 3:
                break
        time.sleep(0.1)
    job_id = json.loads((run / "slurm" / "job.json").read_text())["job_id"]
    subprocess.run(["scancel", job_id], check=True)
    follower.join(timeout=120)
    assert not follower.is_alive()
    captured = capsys.readouterr()
    log = Path(json.loads((run / "slurm" / "job.json").read_text())["log"]).read_text()
    # the job's log holds the run's stdout and stderr: the placement line, the note on receipt, then the run's one line
    lines = [ln for ln in log.splitlines()
             if ln.startswith("stalerl: ") and "received: stopping" not in ln and not ln.startswith("stalerl: placement:")]
    assert len(lines) == 1, log[-3000:]
    assert "interrupted by SIGTERM at step" in lines[0] and "final checkpoint of step" in lines[0], lines
    assert "Traceback" not in log
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted"]["signal"] == "SIGTERM"
    step = s["interrupted"]["checkpoint_step"]
    assert step < 10 and (run / "checkpoints" / f"step_{step}").is_dir()
    assert [r["step"] for r in read_metrics(run)] == list(range(step + 1))
    # the submitting command: one line (not a failure's log tail), the run's own exit code
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert result["rc"] == 143 and len(err) == 1, captured.err[-3000:]
    assert f"job {job_id} CANCELLED" in err[0] and "the run was interrupted by SIGTERM at step" in err[0], err
    # the same submission again: resumes from the final checkpoint, and the metrics are the uninterrupted run's
    assert slurm.launch_slurm(cfg, str(CPU_CONFIG), []) == 0
    assert f"resumed from checkpoint at step {step}" in capsys.readouterr().out
    timing = ("timing/", "throughput/", "memory/", "warm_start/sec")
    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]
    assert comparable(read_metrics(run)) == comparable(read_metrics(run.parent / "uninterrupted"))
