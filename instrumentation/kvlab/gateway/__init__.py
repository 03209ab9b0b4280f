"""The instrumented KV-aware gateway: proxy, load view, block index, scheduler, P/D, DP."""
