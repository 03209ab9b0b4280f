"""kvlab: a hands-on lab and observability stack for KV-cache-aware LLM routing."""

__version__ = "0.1.0"
