"""KV-cache identity and events: token-block hashing, vLLM's KV-event wire format, ZMQ transport."""
