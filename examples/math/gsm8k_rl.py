"""GRPO-style RL on GSM8K with a registered stale-rollout loss (m2po, vanilla, no_trust_region, ...).

    python3 examples/math/gsm8k_rl.py --config examples/math/gsm8k_m2po_cpu.yaml [key=value ...] [--dry-run] [--plot]
    python3 examples/math/gsm8k_rl.py --config gsm8k_m2po.yaml ...   # a bare name: looked up next to this script

A user error prints one line ``stalerl: error: ...`` and exits with code 2 (``--debug`` shows the traceback); a
finished trial is extended by a larger ``total_train_steps``; the run ends with a summary and its output paths.

Every config field can be overridden with a dotted ``key=value`` (``--help`` lists them all with their meaning);
``key=a,b,c`` runs a sweep over the values. What runs, top to bottom (see stalerl/training/trainer.py):
  1. load and validate the config (stalerl/config/); build data, tokenizer and policy;
  2. optional supervised warm start (the embedded tiny model starts from random weights);
  3. loop: generate n samples per prompt (stale FIFO or asynchronous workers under max_head_offpolicyness),
     reward, GRPO advantages, the registered policy loss (recipe/), optimizer step, weight sync;
  4. log metrics.jsonl / TensorBoard, evaluate, checkpoint atomically; resume with recover.mode=auto.
"""

from __future__ import annotations

import sys

from stalerl.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
