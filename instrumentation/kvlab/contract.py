"""What engines and the gateway agree on, apart from the OpenAI API itself: the endpoint a replica
announces (its ready JSON, the endpoints file, discovery) and the usage block the gateway reads
back from every answer (the delivered part of the hit-rate decomposition, docs/DESIGN).

Engines import this module, so it depends on nothing else in kvlab.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One routable replica (or one data-parallel rank of a replica)."""

    name: str                      # stable, human-readable: "sim-0", a pod name, "vllm-1-dp2"
    url: str                       # base URL of its OpenAI API, e.g. http://127.0.0.1:8001
    kv_events: str | None = None   # ZMQ endpoint of its KV events, e.g. tcp://127.0.0.1:5557
    kv_replay: str | None = None   # ZMQ endpoint that replays lost KV-event batches (vLLM's replay_endpoint)
    role: str = "both"             # both | prefill | decode
    dp_rank: int | None = None     # data-parallel rank when the replica runs several
    replica: str | None = None     # the replica this rank belongs to (None: the endpoint is the replica)


class PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    """`usage` of a completion (or of the last streamed chunk when `include_usage` is asked)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: PromptDetails | None = None

    @property
    def cached_tokens(self) -> int:
        return (self.prompt_tokens_details.cached_tokens if self.prompt_tokens_details else None) or 0


class Answer(msgspec.Struct):
    """The parts of a completion (or of one streamed chunk) the gateway reads: choices, usage and,
    from a P/D prefill replica, the KV-transfer parameters for the decode call."""

    choices: list[Any] = []
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


answer_decoder = msgspec.json.Decoder(Answer)
