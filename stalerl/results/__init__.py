"""Results: what a run writes about itself and the tools that read it back. :mod:`~stalerl.results.metrics_log`
(``metrics.jsonl``, TensorBoard, the progress output), :mod:`~stalerl.results.run_summary` (``summary.json``) and
:mod:`~stalerl.results.run_summary_console` (the closing block), :mod:`~stalerl.results.sweep` (sweep grids and their
tables), :mod:`~stalerl.results.report` (``stalerl-report``: tables over seeds, figures) with
:mod:`~stalerl.results.report_stats` (intervals and the tests behind claims: t, TOST, Holm, Fisher),
:mod:`~stalerl.results.report_claims` (the legacy checks of the paper's and AReaL's claims),
:mod:`~stalerl.results.report_prereg` (pre-registered claims and the paired table) with
:mod:`~stalerl.results.report_metrics` (per-run primary metrics and the collapse rule), :mod:`~stalerl.results.pilot`
(a pilot's decision rule), :mod:`~stalerl.results.plot` (``stalerl-plot``). It may import only ``stalerl.core``
and ``stalerl.config``: never training code, so reading a run directory (also one written by an older version)
needs no torch and no model.
"""
