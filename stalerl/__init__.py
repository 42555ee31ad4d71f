"""stalerl: stale-rollout RL for LLMs (async GRPO runtime with the M2PO policy loss)."""

__version__ = "0.1.0"
