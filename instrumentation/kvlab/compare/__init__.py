"""`kvlab compare`: the same replicas and seeded workload through several routers (docs/compare.md)."""
