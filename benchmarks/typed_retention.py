"""Recomputed prompt tokens under LRU vs typed retention, replayed offline (docs/semantic-kv.md).

    .venv/bin/python benchmarks/typed_retention.py [--blocks 720] [--share 0.15] [--live 8] [--agents 2,4,6]

Drives one simulator block pool and scheduler (engine/sim) request by request with the `agentic`
workload of labs/topologies/agentic.yaml, `--live` sessions interleaved step by step, directives
derived by the gateway's code (gateway/retention.py) from each chat request. No clock and no
HTTP: the figures are cache behaviour only (deterministic), not latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.retention import parse
from kvlab.engine.sim.scheduler import FINISHED, Request, Scheduler
from kvlab.gateway.retention import RetentionSettings, derive, header
from kvlab.gateway.tokens import LocalTokens, PromptTokenizer, chat_args
from kvlab.load.workloads import create
from kvlab.tokenizer import Tokenizer
from kvlab.topology import builtin, load_topology

VARIANTS: dict[str, dict[str, Any]] = {
    "LRU (kv-aware)": {"mode": "off"},
    "typed, tools high (default)": {"mode": "typed"},
    "typed, tools normal (kv-aware-typed)": {"mode": "typed", "tools": 50},
    "pin-all (kv-aware-pin-all)": {"mode": "greedy"},
}


def replay(settings: RetentionSettings, params: dict[str, Any], blocks: int, share: float, live: int,
           sessions: int, tok: LocalTokens) -> tuple[int, int]:
    """(recomputed, prompt) tokens over `sessions` sessions, `live` of them interleaved."""
    pool = BlockPool(blocks, 16, events=False, pinned_share=share)
    sched = Scheduler(pool, 64, 2048)
    workload = create("agentic", params=params)
    queue = [workload.session(i) for i in range(sessions)]
    active = [queue.pop(0) for _ in range(live)]
    prompt = cached = n = 0
    while active:
        for session in list(active):
            r = session.pop(0)
            payload = {"messages": r.messages}
            args = chat_args(payload)
            ids, _ = asyncio.run(tok.encode_chat(r.messages, **args))
            found = asyncio.run(derive(settings, payload, ids, r.hint, tok, args))
            req = Request(f"r{n}", ids, [5] * r.max_tokens, sched.prompt_keys(ids),
                          retention=parse(json.loads(header(found))) if found else None)
            n += 1
            sched.add(req)
            while req.status != FINISHED:
                sched.complete(sched.schedule())
            prompt += len(ids)
            cached += req.num_cached or 0
            if not session:
                active.remove(session)
                if queue:
                    active.append(queue.pop(0))
    return prompt - cached, prompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    topology = load_topology(builtin("agentic"))
    p.add_argument("--blocks", type=int, default=topology.sim.num_blocks)
    p.add_argument("--share", type=float, default=topology.sim.typed_retention or 0.15)
    p.add_argument("--agents", default="2,4,6")
    p.add_argument("--live", type=int, default=8, help="sessions interleaved (lab 09: 8 users on one replica)")
    p.add_argument("--sessions", type=int, default=24)
    a = p.parse_args()
    base = dict(topology.workload.params)
    tok = LocalTokens(PromptTokenizer(Tokenizer()))
    table = Table(title=f"recomputed prompt tokens, {a.blocks} blocks, pinned share {a.share:.0%}, "
                        f"{a.live} live sessions, {a.sessions} sessions")
    table.add_column("policy")
    agents = [int(x) for x in a.agents.split(",")]
    for k in agents:
        table.add_column(f"{k} agents", justify="right")
    rows: dict[str, list[str]] = {name: [] for name in VARIANTS}
    for k in agents:
        params = {**base, "agents": k}
        lru = None
        for name, kw in VARIANTS.items():
            recomputed, _prompt = replay(RetentionSettings(**kw), params, a.blocks, a.share, a.live, a.sessions, tok)
            lru = lru or recomputed
            rows[name].append(f"{recomputed:,} ({recomputed / lru - 1:+.0%})")
    for name, cells in rows.items():
        table.add_row(name, *cells)
    Console().print(table)


if __name__ == "__main__":
    main()
