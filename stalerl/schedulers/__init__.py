"""Cluster schedulers that submit a whole run (or a sweep) as batch jobs: ``slurm`` (:mod:`stalerl.schedulers.slurm`).

Nothing is imported here, so that choosing another scheduler pays no import cost for these modules. Schedulers may
import only ``stalerl.core`` and ``stalerl.config``; the job they submit runs ``python -m stalerl.launch.cli``.
"""
