"""stalerl.results."""
