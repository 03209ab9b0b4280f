"""KV events over ZMQ PUB/SUB, framed as vLLM does: [topic, 8-byte big-endian seq, payload].

`EventPublisher` is what an engine (the simulator) uses; `EventSubscriber` is what the gateway
uses. The subscriber reports sequence gaps and restarts (sequence going backwards), so the
consumer can mark that replica's index entries stale and resynchronise. Both speak vLLM's replay
protocol too (ZmqEventPublisher's `replay_endpoint`): a ROUTER socket that, asked with
`[b"", start_seq]`, sends back every buffered `[topic, seq, payload]` from `start_seq` on and then
`[b"", END_SEQ, b""]`, so a subscriber that lost batches can fetch exactly those.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvlab.kvcache.events import Event, KVEventBatch, decode_batch, encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)   # vLLM's end-of-replay marker


def _last_endpoint(sock: zmq.Socket[bytes]) -> str | None:
    """The address a socket bound or connected last (a wildcard port resolved); None before that."""
    raw = sock.last_endpoint
    return raw.decode() if isinstance(raw, bytes) and raw else None


class EventPublisher:
    """Publishes event batches on a bound (`tcp://*:PORT`) or connected PUB socket, keeping the last
    `buffer_steps` for replay when a `replay` endpoint is given (bound; served by a thread)."""

    def __init__(self, endpoint: str, topic: str = "kv-events", data_parallel_rank: int | None = None,
                 hwm: int = 100_000, context: zmq.Context[zmq.Socket[bytes]] | None = None, bind: bool | None = None,
                 replay: str | None = None, buffer_steps: int = 10_000) -> None:
        """`bind`: True binds (e.g. `tcp://127.0.0.1:5557`), False connects; None guesses from the
        endpoint (a `*` or an ipc/inproc address binds)."""
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self._sock.linger = 0
        if bind is None:
            bind = "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        if bind:
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self.endpoint = _last_endpoint(self._sock) or endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        self.replay_endpoint: str | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._replay: zmq.Socket[bytes] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            self._replay.bind(replay)
            self.replay_endpoint = _last_endpoint(self._replay)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-replay", daemon=True)
            self._thread.start()

    def _serve_replay(self) -> None:
        """The replay thread owns the ROUTER socket from here on (and closes it)."""
        sock = self._replay
        assert sock is not None
        try:
            while not self._closed:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                client, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    batches = [b for b in self._buffer if b[0] >= start]
                for seq, payload in batches:
                    sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                sock.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            sock.close(linger=0)

    def publish(self, events: list[Event], ts: float | None = None) -> int:
        """Send one batch; never blocks (drops at the high-water mark, as PUB does). Returns its seq."""
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                             data_parallel_rank=self._rank)
        seq = self._seq
        self._seq += 1
        payload = encode_batch(batch)
        if self._replay is not None:
            with self._lock:
                self._buffer.append((seq, payload))
        try:
            self._sock.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        return seq

    def close(self) -> None:
        self._sock.close(linger=0)
        self._closed = True
        if self._thread is not None:
            self._thread.join(1.0)


@dataclass(slots=True)
class Received:
    """One batch as received. `gap` is the number of batches missed before it (0: none);
    `restarted` is true when the publisher's sequence went backwards (it restarted)."""

    seq: int
    batch: KVEventBatch
    gap: int = 0
    restarted: bool = False


class EventSubscriber:
    """Async SUB socket with sequence tracking. Malformed messages are counted and skipped."""

    def __init__(self, endpoint: str, topic: str = "", context: zmq.asyncio.Context | None = None,
                 replay: str | None = None) -> None:
        self._ctx = context or zmq.asyncio.Context.instance()
        self.replay_endpoint = replay
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.linger = 0
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)
        self.endpoint = endpoint
        self.last_seq: int | None = None
        self.malformed = 0
        self.received = 0

    async def recv(self) -> Received:
        """The next well-formed batch, with gap/restart detection against the previous one."""
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            try:
                batch = decode_batch(frames[2])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.malformed += 1
                continue
            gap, restarted = 0, False
            if self.last_seq is not None:
                if seq <= self.last_seq:
                    restarted = True
                elif seq > self.last_seq + 1:
                    gap = seq - self.last_seq - 1
            self.last_seq = seq
            self.received += 1
            return Received(seq, batch, gap, restarted)

    async def replay(self, start: int, end: int, timeout_s: float = 1.0,
                     partial: bool = False) -> list[Received] | None:
        """Batches `start` .. `end - 1` from the publisher's replay endpoint, or None when there is
        none, it does not answer within `timeout_s`, or it no longer holds all of them (with
        `partial`: those of them it still holds, oldest first)."""
        if self.replay_endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.replay_endpoint)
        got: dict[int, KVEventBatch] = {}
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(left * 1000):
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    continue
                if frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big", signed=True)
                if start <= seq < end:
                    try:
                        got[seq] = decode_batch(frames[3])
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        self.malformed += 1
        finally:
            sock.close(linger=0)
        if len(got) != end - start and not partial:
            return None
        return [Received(seq, got[seq]) for seq in sorted(got)]

    def close(self) -> None:
        self._sock.close(linger=0)
