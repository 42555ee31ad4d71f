"""stalerl.training."""
