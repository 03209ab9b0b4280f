"""Model servers: the vLLM-compatible simulator (`sim/`) and the real-vLLM launcher (`vllm.py`)."""
