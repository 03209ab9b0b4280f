"""KV events over ZMQ PUB/SUB, framed as vLLM does: [topic, 8-byte big-endian seq, payload].

`EventPublisher` is what an engine (the simulator) uses; `EventSubscriber` is what the gateway
uses. The subscriber reports sequence gaps and restarts (sequence going backwards), so the
consumer can mark that replica's index entries stale and resynchronise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvlab.kvcache.events import Event, KVEventBatch, decode_batch, encode_batch


class EventPublisher:
    """Publishes event batches on a bound (`tcp://*:PORT`) or connected PUB socket."""

    def __init__(self, endpoint: str, topic: str = "kv-events", data_parallel_rank: int | None = None,
                 hwm: int = 100_000, context: zmq.Context | None = None, bind: bool | None = None) -> None:
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
        self.endpoint = self._sock.last_endpoint.decode() if self._sock.last_endpoint else endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0

    def publish(self, events: list[Event], ts: float | None = None) -> int:
        """Send one batch; never blocks (drops at the high-water mark, as PUB does). Returns its seq."""
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                             data_parallel_rank=self._rank)
        seq = self._seq
        self._seq += 1
        try:
            self._sock.send_multipart((self._topic, seq.to_bytes(8, "big"), encode_batch(batch)),
                                      flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        return seq

    def close(self) -> None:
        self._sock.close(linger=0)


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

    def __init__(self, endpoint: str, topic: str = "", context: zmq.asyncio.Context | None = None) -> None:
        self._ctx = context or zmq.asyncio.Context.instance()
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

    def close(self) -> None:
        self._sock.close(linger=0)
