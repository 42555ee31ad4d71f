"""Rollouts: :mod:`~stalerl.rollout.batch` (the unit of data between rollout and training),
:mod:`~stalerl.rollout.engine` (HF generation with behaviour log-probs) and :mod:`~stalerl.rollout.vllm_engine` (vLLM,
optional); the staleness bounds are the training loop's (:mod:`stalerl.training.staleness`). It may import
only ``stalerl.core`` (and ``recipe.versions``, the version guard); training imports it, never the other way round.
"""
