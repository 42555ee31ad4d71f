"""Results: what a run writes about itself and the tools that read it back. :mod:`~stalerl.results.metrics_log`
(``metrics.jsonl``, TensorBoard, the progress output), :mod:`~stalerl.results.run_summary` (``summary.json``) and
:mod:`~stalerl.results.run_summary_console` (the closing block), :mod:`~stalerl.results.sweep` (sweep grids and their
tables), :mod:`~stalerl.results.plot` (``stalerl-plot``). It may import only ``stalerl.core`` and ``stalerl.config``:
never training code, so reading a run directory (also one written by an older version) needs no torch and no model.
The study report over seeds (``stalerl-report``), its statistics and claims live in the separate package
:mod:`stalerl_study`, which reads ``summary.json``; nothing here imports it.
"""
