"""What P/D is for, measured from the client: a long prefill sharing an engine step stalls every
running decode. The client's record keeps each gap between tokens (`itl_gaps_ms`) and the worst
one (`itl_max_ms`), which a mean ITL hides; the summary reports them over requests and tokens."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import requests

from conftest import sim_process
from kvlab.load.measure import Record, chat_body, record_of, stream_chat
from kvlab.load.summary import summarize
from kvlab.load.workloads import WorkloadRequest

pytestmark = pytest.mark.slow

PREFILL_MS_PER_TOKEN = 0.25    # cpu-tiny (engine/sim/profiles.yaml); one 2,048-token step holds the whole prompt
LONG_TOKENS = 1500


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    with sim_process(tmp_path_factory.mktemp("sim"), "--replicas", "1", "--no-kv-events",
                     "--profile", "cpu-tiny") as (_, info):
        yield info["replicas"][0]["url"]


def test_a_long_prefill_stalls_a_running_decode_and_the_record_shows_it(replica):
    session = requests.Session()
    streaming = WorkloadRequest(messages=[{"role": "user", "content": "a short question?"}], max_tokens=60, group="decode")
    record = Record(ts=time.time())
    thread = threading.Thread(target=stream_chat, args=(session, f"{replica}/v1/chat/completions",
                                                        chat_body(streaming, "kvlab-tiny", 0), {}, record))
    thread.start()
    time.sleep(0.15)    # the stream is decoding when the long prompt arrives (60 steps take > 300 ms)
    long_prompt = [1000 + i % 1000 for i in range(LONG_TOKENS)]
    r = requests.post(f"{replica}/v1/completions", json={"model": "kvlab-tiny", "prompt": long_prompt,
                                                         "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
    thread.join(60)
    assert record.error is None and record.output_tokens == 60
    gaps = record.itl_gaps_ms
    assert gaps is not None and len(gaps) == 59
    stall = LONG_TOKENS * PREFILL_MS_PER_TOKEN
    # the step that computed the long prompt is one gap at least as long as that prefill...
    assert record.itl_max_ms >= 0.9 * stall and max(gaps) == pytest.approx(record.itl_max_ms, abs=0.1)
    # ...which the mean hides: it stays far below the stall
    assert record.itl_ms < stall / 4 < record.itl_max_ms
    assert record.itl_ms == pytest.approx(float(np.mean(gaps)), rel=0.01)


def test_summary_reports_worst_gaps_and_every_gap():
    smooth = Record(ts=1.0, e2e_ms=500.0, itl_ms=10.0, itl_max_ms=12.0, itl_gaps_ms=[10.0] * 9 + [12.0])
    stalled = Record(ts=1.0, e2e_ms=900.0, itl_ms=46.0, itl_max_ms=370.0, itl_gaps_ms=[10.0] * 9 + [370.0])
    old = record_of(b'{"ts": 1.0, "e2e_ms": 500.0, "itl_ms": 10.0}')   # a record written before these fields existed
    s = summarize([smooth] * 9 + [stalled, old])
    assert s.itl_ms.p50 == 10.0 and s.itl_ms.p99 > 40          # per-request means, as before (+ p99)
    assert s.itl_max_ms.p50 == 12.0 and s.itl_max_ms.p99 > 300
    assert s.token_itl_ms.p50 == 10.0 and s.token_itl_ms.p99 > 12.0   # over the 100 gaps
    assert s.token_itl_ms.mean == pytest.approx((10.0 * 90 + 12.0 * 9 + 370.0) / 100, abs=1e-3)
    assert summarize([old]).itl_max_ms.p50 is None
