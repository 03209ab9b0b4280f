"""The vLLM-compatible simulator: block pool, scheduler, latency profiles, metrics, HTTP server.

A measuring instrument, not a mock: prefill costs time per computed token, so a prefix-cache hit
saves time in proportion to the tokens it does not recompute (docs/simulator.md).
"""
