"""KV events over loopback TCP for a peer router that subscribes only over TCP.

kvlab's vLLM launcher publishes each local replica's KV events on a Unix socket in a per-user 0700
directory (the events carry prompt token ids, so nothing listens on a port; engine/vllm.py).
vllm-router 0.1.17 accepts only `tcp://HOST:PORT` sources. For such a router, `Relay` republishes
each replica's events, frames unchanged (topic, sequence, payload), on a 127.0.0.1 port for as long
as that router runs, then closes it.
"""

from __future__ import annotations

import threading

import zmq

from kvlab.lifecycle import free_port
from kvlab.stack.launch import HOST


class Relay:
    """SUB on each source, PUB on a loopback TCP port each; one forwarding thread."""

    def __init__(self, sources: list[str]) -> None:
        self.ctx = zmq.Context()
        self.subs: list[zmq.Socket[bytes]] = []
        self.pubs: list[zmq.Socket[bytes]] = []
        self.endpoints: list[str] = []
        for source in sources:
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(source)
            pub = self.ctx.socket(zmq.PUB)
            endpoint = f"tcp://{HOST}:{free_port()}"
            pub.bind(endpoint)
            self.subs.append(sub)
            self.pubs.append(pub)
            self.endpoints.append(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._forward, name="kv-event-relay", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        poller = zmq.Poller()
        for sub in self.subs:
            poller.register(sub, zmq.POLLIN)
        route = dict(zip(self.subs, self.pubs, strict=True))
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                route[sock].send_multipart(sock.recv_multipart(zmq.NOBLOCK))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in (*self.subs, *self.pubs):
            sock.close(linger=0)
        self.ctx.term()
