"""The coordinator: the single writer of pool state (leader lease, decide, effects)."""
