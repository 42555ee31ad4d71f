"""Worker roles (rollout, train) and how they are hosted (local processes; Ray in a later version)."""
