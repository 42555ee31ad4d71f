"""stalerl: stale-rollout RL for LLMs (async GRPO runtime with the M2PO policy loss).

The subpackages are the architecture, bottom to top; each imports only the rooms listed after it (checked by
``tests/unit/test_import_graph.py``, lazy imports included):

- :mod:`stalerl.core` -- errors, atomic file writes, the policy model and tokenizer, the reward. Imports nothing here.
- :mod:`stalerl.config` -- the typed experiment config (YAML + dotted overrides). Imports core.
- :mod:`stalerl.data` -- GSM8K files and the synthetic generator, the resumable batch iterator. Imports core.
- :mod:`stalerl.rollout` -- generation engines (HF, vLLM), the rollout batch, staleness admission. Imports core.
- :mod:`stalerl.results` -- what a run leaves behind and the tools that read it: metrics log and progress output,
  ``summary.json``, ``stalerl-plot``, sweep tables. Imports core, config; never training, so they read any run
  directory without torch.
- :mod:`stalerl.schedulers` -- batch-job schedulers (Slurm). Imports core, config.
- :mod:`stalerl.training` -- the training step and loops (sync, fixed staleness, async dX+dY workers), checkpoints,
  trial directories. Imports core, config, data, rollout, results and ``recipe``.
- :mod:`stalerl.launch` -- starting runs: the command line, the launcher, pre-flight checks. Imports everything
  above.

``stalerl.cli`` is kept at the top as the public command module (``python -m stalerl.cli``, ``from stalerl.cli import
main``); it forwards to :mod:`stalerl.launch.cli`.

The study tooling (``stalerl-study``, ``stalerl-report``: grids of runs, tables over seeds, pre-registered claims,
their statistics and power, the pilot) is the separate package :mod:`stalerl_study` of this distribution. It imports
``stalerl``; nothing here imports it.
"""

__version__ = "0.1.0"
