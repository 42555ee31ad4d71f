"""The study tooling: grids of runs and the statistics over them, kept out of the runtime package.

- :mod:`stalerl_study.cli` -- ``stalerl-study``: a study spec's grid run as a sweep on any scheduler, its summaries
  collected next to the docs, the claims' power, the pilot's decision, reuse checks.
- :mod:`stalerl_study.report` -- ``stalerl-report``: tables (mean and 95% interval over seeds) and figures from run
  summaries, and the doc's results blocks.
- :mod:`stalerl_study.stats` -- intervals and the tests behind claims (t, TOST, Holm, Fisher, sign flips, power).
- :mod:`stalerl_study.prereg` -- pre-registered claims and the paired table; :mod:`stalerl_study.metrics` -- per-run
  primary metrics and the collapse rule; :mod:`stalerl_study.claims` -- the legacy checks of the paper's and AReaL's
  claims; :mod:`stalerl_study.pilot` -- a pilot's decision rule.

It may import ``stalerl`` (the run summary, the config, core; ``stalerl-study`` also starts runs through
``stalerl.launch`` and warm starts through ``stalerl.training``); nothing in ``stalerl`` or ``recipe`` imports it
(checked by ``tests/unit/test_import_graph.py``), so the runtime installs and runs without the study tooling.
"""
