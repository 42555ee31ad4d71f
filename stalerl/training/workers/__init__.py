"""Worker roles of an asynchronous run (:mod:`~stalerl.training.workers.rollout_worker`,
:mod:`~stalerl.training.workers.train_worker`) and how they are hosted (:mod:`~stalerl.training.workers.process`:
local spawned processes; :mod:`~stalerl.training.workers.hosting`: local or Ray actors)."""
