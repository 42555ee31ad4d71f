"""Rollouts: :mod:`~stalerl.rollout.batch` (the unit of data between rollout and training),
:mod:`~stalerl.rollout.engine` (HF generation with behaviour log-probs), :mod:`~stalerl.rollout.vllm_engine` (vLLM,
optional) and :mod:`~stalerl.rollout.admission` (the strict staleness bound for asynchronous rollouts). It may import
only ``stalerl.core`` (and ``recipe.versions``, the version guard); training imports it, never the other way round.
"""
