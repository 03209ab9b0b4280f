"""The cross-replica pull decision's cost model (gateway/pull.py): holder vs pull vs recompute."""

from __future__ import annotations

import pytest

from kvlab.contract import Endpoint
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.pull import PullSettings, decide, hint

S = PullSettings(enabled=True, min_tokens=256, link_ms_fixed=2.0, link_ms_per_token=0.02, prefill_ms_per_token=0.5)


def _r(name: str, pending: int = 0, c: float | None = None) -> Backend:
    r = Backend(Endpoint(name=name, url=f"http://{name}"))
    r.pending_prefill_tokens = pending
    r.prefill_ms_per_token = c
    return r


def test_idle_holder_wins():
    d = decide(2000, _r("h"), 1900, _r("t"), 0, S)
    assert d is not None and d.choice == "holder"
    assert d.costs["holder"] == pytest.approx(100 * 0.5)
    assert d.costs["pull"] == pytest.approx(2.0 + 1900 * 0.02 + 100 * 0.5)
    assert d.costs["recompute"] == pytest.approx(2000 * 0.5)


def test_busy_holder_means_pull_and_the_hint_names_it():
    d = decide(2000, _r("h", pending=8000), 1900, _r("t", pending=200), 0, S)
    assert d is not None and d.choice == "pull"
    assert d.costs["holder"] == pytest.approx(8000 * 0.5 + 100 * 0.5)
    assert d.costs["pull"] < d.costs["recompute"] < d.costs["holder"]
    assert hint(d) == "h;1900"


def test_slow_link_means_recompute():
    slow = PullSettings(enabled=True, link_ms_per_token=1.0, prefill_ms_per_token=0.5)
    d = decide(2000, _r("h", pending=8000), 1900, _r("t"), 0, slow)
    assert d is not None and d.choice == "recompute"


def test_learned_cost_per_token_is_used_per_replica():
    d = decide(2000, _r("h", pending=1000, c=0.1), 1900, _r("t", c=2.0), 0, S)
    assert d is not None and d.choice == "holder"
    assert d.costs["holder"] == pytest.approx(1000 * 0.1 + 100 * 0.1)


def test_nothing_to_decide_for_the_holder_itself_or_a_short_gain():
    h = _r("h", pending=8000)
    assert decide(2000, h, 1900, h, 1900, S) is None
    assert decide(2000, h, 300, _r("t"), 100, S) is None      # 200 < min_tokens
