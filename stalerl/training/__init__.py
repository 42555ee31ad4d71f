"""Training: the loop and everything one optimizer step needs. :mod:`~stalerl.training.trainer` is the synchronous
and fixed-staleness loop (generate, stale FIFO, reward and advantage, loss update, log, evaluate, checkpoint);
:mod:`~stalerl.training.async_trainer` the asynchronous dX+dY controller over the processes in
:mod:`stalerl.training.workers`; :mod:`~stalerl.training.actor` the policy update with the registered loss
(``recipe``), data-parallel and :mod:`~stalerl.training.fsdp` ranks; :mod:`~stalerl.training.advantage`,
:mod:`~stalerl.training.staleness`, :mod:`~stalerl.training.warm_start`; :mod:`~stalerl.training.checkpoint` and
:mod:`~stalerl.training.trial_dir` (what a trial directory may resume or extend). It may import ``stalerl.core``,
``stalerl.config``, ``stalerl.data``, ``stalerl.rollout``, ``stalerl.results`` (the metrics log it writes) and
``recipe``; never ``stalerl.launch``.
"""
