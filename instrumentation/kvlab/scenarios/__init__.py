"""`kvlab lab` scenarios beyond the before/after policy comparison (one module each)."""
