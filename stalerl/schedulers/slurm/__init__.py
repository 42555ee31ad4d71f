"""``scheduler.type=slurm``: submit a run (or a sweep, as one job array) with ``sbatch`` and follow it.

    python3 examples/math/gsm8k_rl.py --config exp.yaml scheduler.type=slurm scheduler.slurm.partition=gpu \\
        scheduler.slurm.nodes=2 scheduler.slurm.gpus_per_node=8 [--dry-run]

What happens (:func:`launch_slurm`):

1. The resolved config is written to ``<run_dir>/slurm/config.yaml`` and an sbatch script to
   ``<run_dir>/slurm/job.sbatch`` (both atomically). ``--dry-run`` (or ``scheduler.slurm.dry_run=true``) prints the
   script and stops there.
2. ``sbatch --parsable`` submits it; the job id and the log path (``<run_dir>/slurm/logs/<jobid>.log``, stdout and
   stderr together) are printed. With ``scheduler.slurm.wait=false`` that is all.
3. Inside the allocation the script starts a Ray head on the first node (``ray start --head --block`` on free ports,
   a private ``--temp-dir``), joins the other nodes with ``srun ... ray start --address=... --block``, waits until
   every node is in the cluster, and runs the same controller as a local run:
   ``python -m stalerl.launch.cli --config <run_dir>/slurm/config.yaml scheduler.type=ray scheduler.ray_address=<head>``.
   Its exit code is the job's. On exit only the Ray processes this job started are stopped (SIGTERM to its own
   ``ray start --block`` processes, which shut their node down); ``ray stop`` is *not* used because it kills every
   Ray process of the user on the node, including other jobs' clusters.
   With ``scheduler.slurm.inner_scheduler=local`` no Ray is started and the run uses local worker processes on the
   first node (one node only).
4. While waiting the job log is streamed, state changes are printed, and at the end the seconds from submission to
   the first training step (and the trainer's own ``timing/startup_overhead_s``, which excludes warm start and
   evaluation) are reported. A job that ends in any state but COMPLETED with exit code 0 is reported with its state,
   exit code and the last ``scheduler.slurm.log_tail_lines`` lines of its log, and the return code is non-zero.

Sweeps (:func:`run_sweep_slurm`): ``key=a,b,c`` overrides (expanded by :mod:`stalerl.results.sweep`) become one job array
``--array=0-(n-1)[%max_parallel]``; task ``i`` reads its resolved config path from line ``i+1`` of the runs file and
runs it. Inside array tasks the inner scheduler defaults to ``local``: each task is a self-contained run on its own
allocation, with no Ray cluster to start (seconds per task) and nothing shared between tasks; set
``scheduler.slurm.inner_scheduler=ray`` for runs that need several nodes per task.

Quoting: every user-provided value that reaches the script is either validated against a strict pattern
(partition, account, time, mem, the names of extra sbatch options) or quoted: ``shlex.quote`` in the bash body, and
for ``#SBATCH`` lines the quoting sbatch's own line parser understands (double quotes, backslash escapes).
Values with a newline, NUL or other control character are rejected with an error naming the key. No value is ever
``eval``-ed; per-task data is read from files into quoted variables.
"""

from stalerl.config.slurm import _check_text, _control_problem, _raise_slurm_problems, slurm_config_problems
from stalerl.schedulers.slurm.follow import _Follower, _first_step_record, _startup_report, follow_job
from stalerl.schedulers.slurm.jobs import (
    TERMINAL_STATES,
    JobInfo,
    SlurmError,
    _expand_tasks,
    _parse_scontrol,
    _run,
    _tail,
    cancel,
    job_log_path,
    job_state,
    job_states,
    submit,
    wait_for_job,
    wait_for_jobs,
)
from stalerl.schedulers.slurm.render import (
    LAUNCH_TIME_ENV,
    _inner_scheduler,
    _python,
    _slurm_filename_dir,
    inner_command,
    render_sbatch,
    sbatch_quote,
)
from stalerl.schedulers.slurm.submission import (
    _atomic_write,
    _check_inner,
    _check_run_names,
    _job_name,
    launch,
    launch_slurm,
)
from stalerl.schedulers.slurm.sweeps import _slurm_settings, run_sweep, run_sweep_slurm

__all__ = [
    "JobInfo",
    "SlurmError",
    "TERMINAL_STATES",
    "inner_command",
    "job_log_path",
    "job_state",
    "job_states",
    "launch",
    "launch_slurm",
    "render_sbatch",
    "run_sweep",
    "run_sweep_slurm",
    "sbatch_quote",
    "slurm_config_problems",
    "submit",
    "wait_for_job",
    "wait_for_jobs",
]
