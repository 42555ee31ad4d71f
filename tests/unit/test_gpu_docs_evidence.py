"""The GPU check's evidence in git: docs/gpu.md's file list for each committed run against the files there (and a
committed manifest against its files' bytes), nothing under docs/gpu ignored by .gitignore, and
scripts/gpu_check_evidence.py writing the raw files with only its stated path redaction."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess

from conftest import REPO

_spec = importlib.util.spec_from_file_location("gpu_check_evidence", REPO / "scripts" / "gpu_check_evidence.py")
ev = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ev)

GPU_DOCS = REPO / "docs" / "gpu"
LIST_LINE = re.compile(r"^Files in \[`docs/gpu/([^/`]+)/`\]\([^)]*\): (.*)$")


def documented() -> dict[str, set[str]]:
    """docs/gpu.md's lines 'Files in [`docs/gpu/NAME/`](...): `a`, `b/c`, ...' -> {NAME: {a, b/c}}."""
    out: dict[str, set[str]] = {}
    for line in (REPO / "docs" / "gpu.md").read_text().splitlines():
        m = LIST_LINE.match(line.strip())
        if m:
            out[m.group(1)] = set(re.findall(r"`([^`]+)`", m.group(2)))
    return out


def on_disk(run: str) -> set[str]:
    root = GPU_DOCS / run
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_docs_gpu_md_lists_exactly_the_files_of_each_committed_run():
    listed = documented()
    runs = sorted(p.name for p in GPU_DOCS.iterdir() if p.is_dir())
    assert runs and sorted(listed) == runs, (sorted(listed), runs)
    for run in runs:
        names = set(listed[run])
        if "MANIFEST.sha256" in names:  # the manifest stands for the files it lists
            for line in (GPU_DOCS / run / "MANIFEST.sha256").read_text().splitlines():
                digest, rel = line.split("  ", 1)
                assert hashlib.sha256((GPU_DOCS / run / rel).read_bytes()).hexdigest() == digest, (run, rel)
                names.add(rel)
        assert names == on_disk(run), (run, names ^ on_disk(run))


def test_nothing_under_docs_gpu_is_ignored():
    files = [str(p.relative_to(REPO)) for p in GPU_DOCS.rglob("*") if p.is_file()]
    files += ["docs/gpu/h100-2027-01-01/runs/smollm2-add-m2po-cpu/real-model-bfloat16/metrics.jsonl",
              "docs/gpu/h100-2027-01-01/runs/gsm8k-m2po/real-scale/config.yaml",
              "docs/gpu/h100-2027-01-01/logs/real_scale.log"]
    res = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=REPO, capture_output=True, text=True)
    assert res.stdout == "", res.stdout  # a run's evidence must not be dropped by runs/ or any other pattern
    assert subprocess.run(["git", "check-ignore", "-q", "--no-index", ".gpu_check/identity.json"],
                          cwd=REPO).returncode == 0


def test_evidence_is_the_raw_output_with_only_the_paths_redacted(tmp_path):
    out, repo, work = tmp_path / "out", tmp_path / "repo", tmp_path / "scratch"
    run = out / "runs" / "gsm8k-m2po" / "real-scale"
    for d in (out / "logs", out / "parts", run / "checkpoints" / "step_1", repo, work):
        d.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check_report.json").write_text(json.dumps({"out_dir": str(out), "x": 1}))
    (out / "console.log").write_text(f"gpu_check: report in {out}; scratch {work}; repo {repo}/scripts\n"
                                     f"gpu_check: wheels in {tmp_path}/whl/\n")
    (out / "logs" / "real_scale.log").write_text(f"actor.path={work}/real/model\n")
    (run / "config.yaml").write_text(f"cluster:\n  fileroot: {out}/runs\nactor:\n  path: {work}/real/model\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "actor/loss": 0.5}\n')
    (run / "summary.json").write_text('{"code": {"commit": "abc", "dirty": true}}')
    (run / "checkpoints" / "step_1" / "state.pt").write_bytes(b"\0" * 10)
    (out / "parts" / "weights.pt").write_bytes(b"\0")
    dest = ev.write_evidence(out, repo, work, home=None, also={"wheels": f"{tmp_path}/whl/"})
    got = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert got == {"gpu_check_report.json", "console.log", "logs/real_scale.log", "MANIFEST.sha256", "REDACTION.json",
                   "runs/gsm8k-m2po/real-scale/config.yaml", "runs/gsm8k-m2po/real-scale/metrics.jsonl",
                   "runs/gsm8k-m2po/real-scale/summary.json"}
    assert (dest / "console.log").read_text() == ("gpu_check: report in <out>; scratch <work>; repo <repo>/scripts\n"
                                                  "gpu_check: wheels in <wheels>/\n")
    assert (dest / "runs/gsm8k-m2po/real-scale/config.yaml").read_text() == (
        "cluster:\n  fileroot: <out>/runs\nactor:\n  path: <work>/real/model\n")
    assert (dest / "runs/gsm8k-m2po/real-scale/metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    for f in dest.rglob("*"):
        if f.is_file():
            text = f.read_text()
            assert str(tmp_path) not in text, f
    manifest = dict(reversed(line.split("  ", 1)) for line in (dest / "MANIFEST.sha256").read_text().splitlines())
    assert set(manifest) == got - {"MANIFEST.sha256", "REDACTION.json"}
    for rel, digest in manifest.items():
        assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == digest
    red = json.loads((dest / "REDACTION.json").read_text())
    assert red["replaced"]["console.log"] == {"<out>": 1, "<work>": 1, "<repo>": 1, "<wheels>": 1}
    assert "metrics.jsonl" not in " ".join(red["replaced"])  # nothing replaced there: byte for byte
