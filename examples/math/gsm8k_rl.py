"""GRPO-style RL on GSM8K with a registered stale-rollout loss (m2po, vanilla, no_trust_region, ...).

    python3 examples/math/gsm8k_rl.py --config examples/math/gsm8k_m2po_cpu.yaml [key=value ...] [--dry-run] [--plot]

Every config field can be overridden with a dotted ``key=value``; ``--help`` lists them all with their meaning.
"""

from __future__ import annotations

import sys

from stalerl.config import load_config, parse_args
from stalerl.launcher import launch
from stalerl.workers.process import WorkerFailure, failure_exit_code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _, _, flags = parse_args(argv)
    cfg = load_config(argv)
    try:
        launch(cfg, dry_run=bool(flags.get("dry_run")), plot=bool(flags.get("plot")))
    except WorkerFailure as failure:  # a rollout or train worker raised or died: its code and log tail
        print(f"stalerl: {failure}", file=sys.stderr)
        return failure_exit_code(failure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
