"""Speculative blocks (and the pending-prefill book) in the gateway, against real `kvlab engine sim` replicas: two requests that
share a long prefix and arrive back to back, before the first one's BlockStored can have reached
the gateway, go to the same replica under the precise kv-aware policy; with the speculative layer
off, load sends the second one elsewhere (the scatter issue 17 measured)."""

from __future__ import annotations

import asyncio

import pytest

from conftest import sim_process
from kvlab.contract import Endpoint
from kvlab.telemetry import names
from test_gateway_sim import InProcessGateway, doc

pytestmark = pytest.mark.slow


async def back_to_back(eps: list[Endpoint], ttl_s: float, group: int) -> tuple[list[dict[str, str]], int]:
    g = InProcessGateway("kv-aware", eps)
    g.gw.precise.speculative_ttl_s = ttl_s
    async with g:
        await g.reset(eps)
        for _ in range(100):   # the reset's AllBlocksCleared makes every event stream live
            if all(r.events_state == "live" for r in g.gw.registry.replicas.values()):
                break
            await asyncio.sleep(0.05)
        assert all(r.events_state == "live" for r in g.gw.registry.replicas.values())
        assert g.gw.precise.total_blocks() == 0
        answers = await asyncio.gather(g.chat(doc(group, 80), "first question", stream=True),
                                       g.chat(doc(group, 80), "second question", stream=True))
        for status, _, body in answers:
            assert status == 200, body
        for _ in range(40):   # the engine's BlockStored events trail the responses a little
            if g.gw.precise.confirmed or not ttl_s:
                break
            await asyncio.sleep(0.05)
        confirmed = g.gw.precise.confirmed
        # the pending-prefill book released both requests at their first token and learned a cost
        reps = g.gw.registry.replicas
        assert all(r.pending_prefill_tokens == 0 for r in reps.values())
        assert reps[answers[0][1][names.HEADER_ROUTED_TO]].prefill_ms_per_token is not None
    return [h for _, h, _ in answers], confirmed


def test_back_to_back_shared_prefix_lands_on_one_replica(tmp_path):
    with sim_process(tmp_path, "--replicas", "3", "--time-scale", "0.2") as (_, ready):
        eps = [Endpoint(**r) for r in ready["replicas"]]
        (h1, h2), confirmed = asyncio.run(asyncio.wait_for(back_to_back(eps, 30.0, 1), 60))
        assert h1[names.HEADER_ROUTED_TO] == h2[names.HEADER_ROUTED_TO]
        assert int(h1[names.HEADER_PREFIX_PREDICTED]) == 0
        # the second request's whole predicted prefix was speculative: no BlockStored had arrived yet
        predicted = int(h2[names.HEADER_PREFIX_PREDICTED])
        assert predicted > 1000 and int(h2[names.HEADER_PREFIX_SPECULATIVE]) == predicted
        assert confirmed > 0   # the engine's BlockStored later confirmed the speculative blocks

        (h1, h2), _ = asyncio.run(asyncio.wait_for(back_to_back(eps, 0.0, 2), 60))
        assert h1[names.HEADER_ROUTED_TO] != h2[names.HEADER_ROUTED_TO]
        assert int(h2[names.HEADER_PREFIX_SPECULATIVE]) == 0
