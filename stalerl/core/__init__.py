"""stalerl.core."""
