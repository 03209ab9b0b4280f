"""Measure one streamed chat completion from the client's side.

TTFT is the time to the first streamed chunk whose text is non-empty (kvlab's tokenizer decodes
every id to visible text, so this is well defined even for random-weight models); ITL is the mean
gap between successive non-empty chunks, and the gaps themselves are kept (the worst one is a
decode stall a mean hides, e.g. a long prefill sharing the engine step); TPOT is
(e2e - TTFT) / (output tokens - 1). Prompt,
output and cached token counts come from the final usage chunk; the routing decision from the
gateway's `x-kvlab-*` headers. Plain `requests`, so it runs under Locust's gevent and in tests.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import requests

from kvlab.load.workloads import WorkloadRequest
from kvlab.telemetry import names

_decode = msgspec.json.Decoder().decode


class Record(msgspec.Struct, kw_only=True):
    """One request as written to requests.jsonl (schema in docs/lab.md)."""

    ts: float                      # unix time the request was sent (open loop: scheduled to be sent)
    phase: str = ""
    policy: str = ""
    workload: str = ""
    group: str = ""
    turn: int = 0
    session: int | None = None     # which session of the workload's seeded stream (load.oracle replays it)
    step: int = 0                  # the request's position in its session
    status: int = 0                # HTTP status (0: no response)
    ttft_ms: float | None = None
    itl_ms: float | None = None    # mean inter-token latency
    itl_max_ms: float | None = None      # the worst gap between two tokens (a decode stall)
    itl_gaps_ms: list[float] | None = None   # every gap between two tokens, 0.1 ms resolution
    tpot_ms: float | None = None
    e2e_ms: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None      # delivered: usage.prompt_tokens_details.cached_tokens
    available_tokens: int | None = None   # gateway header x-kvlab-prefix-available
    predicted_tokens: int | None = None   # gateway header x-kvlab-prefix-predicted
    speculative_tokens: int | None = None  # gateway header x-kvlab-prefix-speculative (part of predicted)
    replica: str | None = None
    pd: str | None = None                 # gateway header x-kvlab-pd-decision: split | unified | fallback
    trace_id: str | None = None
    error: str | None = None
    lateness_ms: float | None = None      # open loop: how long after its scheduled time it was sent
                                          # (TTFT and E2E include it: they count from the schedule)


UNFINISHED = "unfinished when the phase ended"   # the error of an open-loop request still running at the end


def record_of(line: bytes) -> Record | None:
    """One requests.jsonl line as a Record; None for a line cut short by a killed writer or one
    that is no record. Older files lack later keys (their defaults apply); a null where a record
    now always has a value counts as absent."""
    try:
        row = _decode(line)
        if not isinstance(row, dict):
            return None
        return msgspec.convert({k: v for k, v in row.items() if v is not None}, Record)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def read_records(path: str | Path) -> list[Record]:
    """Every record of a requests.jsonl ([] when there is none)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [r for line in p.read_bytes().splitlines() if line.strip() and (r := record_of(line)) is not None]


def chat_body(req: WorkloadRequest, model: str, seed: int) -> dict[str, Any]:
    """The request body: fixed output length (vLLM's min_tokens/ignore_eos) and usage in the stream."""
    return {
        "model": model,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "min_tokens": req.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _int_header(headers: Any, name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def stream_chat(session: requests.Session, url: str, body: dict[str, Any], headers: dict[str, str],
                record: Record, timeout: float = 300.0) -> Record:
    """POST `body` (stream=True) to `url` and fill `record` with what was measured; never raises."""
    start = time.perf_counter()
    token_times: list[float] = []
    usage: dict[str, Any] | None = None
    done = False
    try:
        with session.post(url, json=body, headers=headers, stream=True, timeout=timeout) as resp:
            record.status = resp.status_code
            h = resp.headers
            record.replica = h.get(names.HEADER_ROUTED_TO) or h.get(names.HEADER_REPLICA)
            record.policy = h.get(names.HEADER_POLICY) or record.policy
            record.prompt_tokens = _int_header(h, names.HEADER_PROMPT_TOKENS)
            record.available_tokens = _int_header(h, names.HEADER_PREFIX_AVAILABLE)
            record.predicted_tokens = _int_header(h, names.HEADER_PREFIX_PREDICTED)
            record.speculative_tokens = _int_header(h, names.HEADER_PREFIX_SPECULATIVE)
            record.pd = h.get(names.HEADER_PD_DECISION)
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return record
            # chunk_size=None: yield bytes as they arrive (a fixed size would wait to fill it)
            for line in resp.iter_lines(chunk_size=None):  # type: ignore[call-overload]  # stubs lack None
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = _decode(data)
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:300]}"
                    break
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content") or choice.get("text"):
                        token_times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (requests.RequestException, msgspec.DecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    record.e2e_ms = (end - start) * 1000
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")
    else:
        record.output_tokens = len(token_times)
    if token_times:
        record.ttft_ms = (token_times[0] - start) * 1000
        if len(token_times) > 1:
            record.itl_ms = (token_times[-1] - token_times[0]) * 1000 / (len(token_times) - 1)
            record.itl_gaps_ms = [round((b - a) * 1000, 1) for a, b in zip(token_times, token_times[1:])]
            record.itl_max_ms = max((b - a) * 1000 for a, b in zip(token_times, token_times[1:]))
        if record.output_tokens > 1:
            record.tpot_ms = (end - token_times[0]) * 1000 / (record.output_tokens - 1)
    if record.error is None and not done:
        record.error = "stream ended without [DONE]"
    if record.error is None and not token_times:
        record.error = "no tokens streamed"
    return record
