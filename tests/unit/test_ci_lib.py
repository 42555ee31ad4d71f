"""scripts/ci_lib.sh, the steps the separate-environment CI lanes share: the check that installing stalerl beside a
framework leaves the framework's environment as it was, and the junit gate on a lane's tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def _bash(script: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; . {REPO / 'scripts' / 'ci_lib.sh'}; {script}"],
                          cwd=cwd, capture_output=True, text=True)


@pytest.mark.parametrize("after, mode, ok", [
    (["a==1", "b==2"], "identical", True),
    (["a==1", "b==2", "c==3"], "identical", False),  # something added
    (["a==1", "b==2", "c==3"], "additions-ok", True),
    (["a==1", "b==3"], "additions-ok", False),  # a framework's package changed version
    (["a==1"], "additions-ok", False),  # removed
])
def test_require_unchanged(tmp_path, after, mode, ok):
    (tmp_path / "before.txt").write_text("a==1\nb==2\n")
    (tmp_path / "after.txt").write_text("\n".join(after) + "\n")
    res = _bash(f"ci_require_unchanged before.txt after.txt Fw {mode}; echo reached", tmp_path)
    assert (res.returncode == 0 and "reached" in res.stdout) == ok, (res.stdout, res.stderr)
    if ok:
        assert "left Fw's environment as it was (2 packages unchanged" in res.stdout
        assert ("added: c==3" in res.stdout) == (len(after) == 3)
    else:
        assert "installing stalerl changed Fw's environment" in res.stderr


def test_require_unchanged_refuses_an_unknown_mode(tmp_path):
    (tmp_path / "x.txt").write_text("a==1\n")
    res = _bash("ci_require_unchanged x.txt x.txt Fw additions_ok", tmp_path)
    assert res.returncode == 2 and "expected identical or additions-ok" in res.stderr


@pytest.mark.parametrize("body, ok", [
    ("import os\n\ndef test_a():\n    assert os.environ['REQUIRE_FW'] == '1'\n", True),  # the framework is required
    ("def test_a():\n    assert False\n", False),
    ("import pytest\n\ndef test_a():\n    pytest.skip('framework missing')\n", False),  # a skip fails the lane
])
def test_marked_tests_pass_only_when_tests_ran_and_none_failed_or_skipped(tmp_path, body, ok):
    # A lane's layout in miniature: tests/integrations/<mark>/ under the repository root, scripts/junit_check.py.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "junit_check.py").write_text((REPO / "scripts" / "junit_check.py").read_text())
    d = tmp_path / "tests" / "integrations" / "fw"
    d.mkdir(parents=True)
    (d / "test_fw.py").write_text("import pytest\npytestmark = pytest.mark.fw\n" + body)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    fw: the fake framework\n")

    res = _bash(f"VENV={tmp_path}; PY={sys.executable}; rc=0; ci_marked_tests Fw fw REQUIRE_FW || rc=$?; "
                "echo rc=$rc", tmp_path)
    assert res.returncode == 0, res.stderr
    assert (res.stdout.strip().endswith("rc=0")) == ok, res.stdout
    assert (tmp_path / "fw-tests.xml").is_file()
