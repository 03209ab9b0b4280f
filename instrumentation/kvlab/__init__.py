"""kvlab: a hands-on lab and observability stack for KV-cache-aware LLM routing."""

import os

__version__ = "0.1.0"

# transformers' import-time advice ("PyTorch was not found. Models won't be available ...") reaches a
# lab's console, where a learner reads it as an error; kvlab uses only its tokenizers without torch,
# and `kvlab doctor` says in kvlab's words what real vLLM needs. Set here so every kvlab process and
# the children it starts inherit it; a user's own setting wins.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
