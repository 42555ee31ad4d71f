"""Installed on PYTHONPATH by bench/trl_vs_stalerl.py for the processes of one measured run (TRL's, stalerl's and
its workers): when STALERL_BENCH_PROBE_DIR is set, records what every forward and generate of this process ran
(bench/_forward_dtype.py). A no-op otherwise."""

import os

if os.environ.get("STALERL_BENCH_PROBE_DIR"):
    import importlib.util
    import sys

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_forward_dtype.py")
    _spec = importlib.util.spec_from_file_location("_forward_dtype", _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["_forward_dtype"] = _module  # the bench's own `import _forward_dtype` then gets this instance
    _spec.loader.exec_module(_module)
    _module.install_from_env()
