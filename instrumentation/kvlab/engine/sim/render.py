"""vLLM's render response: what `/v1/chat/completions/render` and `/v1/completions/render` return.

vLLM (`--enable-scale-out`, vllm/entrypoints/scale_out/render/) answers a chat or completion request
with the token-in `GenerateRequest` it would run (prompt token ids and sampling parameters) instead
of running it; vllm-router 0.1.17's `cache_aware` asks every worker for it before routing (its
primary path; `/tokenize` where render is missing) and keeps its tree over those token ids. The
simulator answers with the ids it would prefill for that request.
"""

from __future__ import annotations

from typing import Any

from kvlab.engine.sim.protocol import _Generation

_FINAL_ONLY, _DELTA = 2, 1   # vLLM's RequestOutputKind


def generate_request(request_id: str, ids: list[int], body: _Generation, max_tokens: int) -> dict[str, Any]:
    """A `GenerateRequest` as vLLM dumps it (SamplingParams omit their defaults)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    params: dict[str, Any] = {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "min_p": 0.0,
        **({"seed": body.seed} if body.seed is not None else {}),
        "stop": stop, "stop_token_ids": [], "max_tokens": max_tokens,
        **({"min_tokens": body.min_tokens} if body.min_tokens else {}),
        **({"ignore_eos": True} if body.ignore_eos else {}),
        "output_kind": _DELTA if body.stream else _FINAL_ONLY, "skip_clone": True,
        "bad_words": [], "skip_reading_prefix_cache": False}
    return {
        "request_id": request_id, "token_ids": ids, "token_offsets": None, "features": None,
        "content_parts": None, "sampling_params": params, "model": body.model,
        "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
        "output_mode": "tokens", "stream": bool(body.stream),
        "stream_options": ({"include_usage": body.stream_options.include_usage,
                            "continuous_usage_stats": body.stream_options.continuous_usage_stats}
                           if body.stream and body.stream_options else None),
        "cache_salt": None, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None}
