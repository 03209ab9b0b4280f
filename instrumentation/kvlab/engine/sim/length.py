"""The model length's two rules, as vLLM applies them: an engine whose max model length exceeds its
KV cache does not start (one request of that length could never be scheduled), and a request
whose prompt plus max_tokens exceeds the max model length is answered 400. `kvlab engine sim` and
`kvlab twin` both check here."""

from __future__ import annotations

from kvlab.errors import ConfigError

TOO_LONG = "maximum context length"   # what names the 400 in the message (and in a client's error record)


def check_cache(max_model_len: int, num_blocks: int, block_size: int, flag: str = "--max-model-len") -> None:
    """A ConfigError when a request of the max model length would not fit the KV cache."""
    if max_model_len > num_blocks * block_size:
        raise ConfigError(f"{flag} {max_model_len} exceeds the KV cache ({num_blocks} blocks x {block_size} tokens "
                          f"= {num_blocks * block_size}): raise --num-blocks or lower {flag}")


def too_long(prompt_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """vLLM's 400 message for a request longer than the model takes; None when it fits."""
    if prompt_tokens + max_tokens <= max_model_len:
        return None
    return (f"This model's {TOO_LONG} is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.")
