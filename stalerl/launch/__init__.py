"""stalerl.launch."""
