"""The main job's public command module: ``python -m stalerl.cli`` and ``from stalerl.cli import main``.

The code lives in :mod:`stalerl.launch.cli`; this module only forwards to it (``python -m`` runs a file), so the
public command stays ``python -m stalerl.cli`` whatever the runtime's internal layout.
"""

import sys

from stalerl.launch.cli import main, one_line, run_sweep, run_sweep_on  # noqa: F401 - the public names

if __name__ == "__main__":
    sys.exit(main())
