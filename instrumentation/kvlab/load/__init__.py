"""Load generation: deterministic workloads, Locust users that measure streaming, `kvlab bench`."""
