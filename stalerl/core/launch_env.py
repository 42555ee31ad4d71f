"""Environment variables shared by the command line and the trainers (torch-free, so the CLI stays fast)."""

# When the job was launched (time.time()), for the start-up overhead metric; inherited by workers, tasks and jobs.
LAUNCH_TIME_ENV = "STALERL_LAUNCH_TIME"
