"""The run pipeline: a bench spec, a stack, phases of load, one report (docs/architecture.md)."""
