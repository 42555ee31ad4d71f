"""Run several ``swift rlhf`` argument lists in one process, through ``swift.pipelines.rlhf_main`` (what the
``swift rlhf`` command runs in its child process), so ms-swift's imports (~15 s of CPU) are paid once.

Usage: ``python _swift_runs.py RUNS.json`` with a list of ``{"argv": [...], "env": {...}}``; each run's
environment is applied for that run only. A run with ``"error_file"`` is expected to fail: its exception's message
is written there (and the next run goes on); it is an error if it does not fail.
"""

from __future__ import annotations

import json
import os
import sys


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        runs = json.load(f)
    from swift.pipelines import rlhf_main

    for run in runs:
        saved = dict(os.environ)
        os.environ.update(run["env"])
        try:
            if run.get("error_file"):
                try:
                    rlhf_main(run["argv"])
                except Exception as exc:  # noqa: BLE001 - the test reads the message
                    with open(run["error_file"], "w", encoding="utf-8") as f:
                        f.write(f"{type(exc).__name__}: {exc}")
                else:
                    raise SystemExit(f"run {run['argv'][-1]} was expected to fail and did not")
            else:
                rlhf_main(run["argv"])
        finally:
            os.environ.clear()
            os.environ.update(saved)


if __name__ == "__main__":
    main(sys.argv[1])
