"""The main job's public command module: ``python -m stalerl.cli`` and ``from stalerl.cli import main``.

The code lives in :mod:`stalerl.launch.cli`; this module only forwards to it, so commands in docs, scripts and Slurm
job files written before the runtime was grouped into subpackages keep working.
"""
# restructure: keep-old-paths (a compat module: /work/wt-tools/restructure.py neither moves nor rewrites it)

import sys

from stalerl.launch.cli import main, one_line, run_sweep, run_sweep_on  # noqa: F401 - the public names

if __name__ == "__main__":
    sys.exit(main())
