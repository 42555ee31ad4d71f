"""Launching runs: :mod:`~stalerl.launch.cli` (the main job's command line: config lookup, overrides, sweeps,
schedulers, exit codes), :mod:`~stalerl.launch.launcher` (one run in this process, in a Ray task or as workers),
:mod:`~stalerl.launch.preflight` (resource and path checks before any work), :mod:`~stalerl.launch.config_lookup`
(``--config`` by bare name) and :mod:`~stalerl.launch.model_cli` (``stalerl-model``). This is the top floor: it may
import every other room; nothing in ``stalerl`` imports it (``stalerl.cli`` forwards here). ``stalerl-study`` (a grid
of runs, then the report) is in the separate package :mod:`stalerl_study`, which starts its runs through here.
"""
