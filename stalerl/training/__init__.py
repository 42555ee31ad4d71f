"""Training: the loop and everything one optimizer step needs. :mod:`~stalerl.training.trainer` is the one loop
(batch from a rollout source, reward and advantage, loss update, log, evaluate, checkpoint);
:mod:`~stalerl.training.sources` its rollout sources: the synchronous fixed-staleness FIFO, and
:mod:`~stalerl.training.async_source` the asynchronous dX+dY source over the processes in
:mod:`stalerl.training.workers`; :mod:`~stalerl.training.staleness` both staleness mechanisms;
:mod:`~stalerl.training.actor` the policy update with the registered loss (``recipe``), data-parallel and
:mod:`~stalerl.training.fsdp` ranks; :mod:`~stalerl.training.advantage`, :mod:`~stalerl.training.warm_start`; :mod:`~stalerl.training.checkpoint` and
:mod:`~stalerl.training.trial_dir` (what a trial directory may resume or extend). It may import ``stalerl.core``,
``stalerl.config``, ``stalerl.data``, ``stalerl.rollout``, ``stalerl.results`` (the metrics log it writes) and
``recipe``; never ``stalerl.launch``.
"""
