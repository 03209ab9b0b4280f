"""The kvlab locustfile: `locust -f labs/locustfile.py` (web UI) or `kvlab bench` (headless).

Options (Locust custom arguments, shown in the web UI, or env vars): --workload (KVLAB_WORKLOAD),
--workload-params JSON (KVLAB_WORKLOAD_PARAMS), --seed (KVLAB_SEED), --model (KVLAB_MODEL),
--phase / --policy labels (KVLAB_PHASE, KVLAB_POLICY), --requests-out FILE (KVLAB_REQUESTS_OUT:
one JSON line per request). Open loop: --rate R (KVLAB_RATE) with --arrival poisson|constant|gamma:CV
(KVLAB_ARRIVAL), or --time-scale F (KVLAB_TIME_SCALE) to replay the `trace` workload at its own
timestamps times F; run it with one user (docs/open-loop.md). Without --host the gateway of the newest local stack
(runs/latest/stack.json) is the target.
"""

from __future__ import annotations

import atexit
import itertools
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
from locust import events

from kvlab.load import users
from kvlab.load.arrival import arrival
from kvlab.load.stages import parse, send_times
from kvlab.load.users import ChatUser
from kvlab.load.workloads import NAMES, create
from kvlab.stack.base import read_info
from kvlab.stack.state import runs_dir
from kvlab.telemetry.setup import configure_tracing, shutdown_tracing

__all__ = ["ChatUser"]

_out: IO[str] | None = None


def _stack_gateway() -> str | None:
    stack = read_info(runs_dir() / "latest")
    return stack.gateway if stack is not None else None


ChatUser.host = _stack_gateway()

# kvlab stops a phase early with SIGINT (load/runner.stop). A shell starts a background job (`kvlab lab
# &`, nohup) with SIGINT ignored, and exec keeps an ignored signal: Locust would miss it and send for
# the whole grace period, every one of those requests counted in the phase.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]  # locust's event hooks are untyped
def _options(parser: Any) -> None:
    parser.add_argument("--workload", choices=NAMES, default="shared-prefix", env_var="KVLAB_WORKLOAD",
                        help="kvlab workload")
    parser.add_argument("--workload-params", default="{}", env_var="KVLAB_WORKLOAD_PARAMS",
                        help="JSON object of workload parameters, e.g. {\"groups\": 16}")
    parser.add_argument("--seed", type=int, default=0, env_var="KVLAB_SEED", help="workload seed")
    parser.add_argument("--model", default="kvlab-tiny", env_var="KVLAB_MODEL", help="served model name")
    parser.add_argument("--phase", default="", env_var="KVLAB_PHASE", help="label written to each record")
    parser.add_argument("--policy", default="", env_var="KVLAB_POLICY",
                        help="label written to each record (the gateway's header wins)")
    parser.add_argument("--rate", type=float, default=0.0, env_var="KVLAB_RATE",
                        help="open loop: requests/s (0: closed loop, each user sends when its last reply ends)")
    parser.add_argument("--arrival", default="poisson", env_var="KVLAB_ARRIVAL",
                        help="open loop: poisson | constant | gamma:CV")
    parser.add_argument("--stages", default="", env_var="KVLAB_STAGES",
                        help="open loop, a stepped ramp: RATE:SECONDS,... sent by --arrival (load/stages.py)")
    parser.add_argument("--time-scale", type=float, default=0.0, env_var="KVLAB_TIME_SCALE",
                        help="open loop, trace workload: its timestamps times this (0: not a trace replay)")
    parser.add_argument("--requests-out", default="", env_var="KVLAB_REQUESTS_OUT",
                        help="write one JSON line per request to this file")


_ready: users.Feed | None = None   # headless: the feed made before the run time starts


def _feed(opts: Any) -> users.Feed:
    workload = create(opts.workload, seed=opts.seed, params=json.loads(opts.workload_params or "{}"))
    return users.Feed(workload, model=opts.model, phase=opts.phase, policy=opts.policy,
                      schedule=_schedule(workload, opts)).warm()


@events.init.add_listener  # type: ignore[untyped-decorator]  # locust's event hooks are untyped
def _init(environment: Any, **_: Any) -> None:
    global _ready
    configure_tracing("kvlab-locust")
    atexit.register(shutdown_tracing)   # at exit, not at `quitting`: spans of requests finishing after it
    opts = environment.parsed_options
    if opts is not None and opts.headless:   # the web UI's form may change the options: made at each start
        _ready = _feed(opts)


@events.test_start.add_listener  # type: ignore[untyped-decorator]  # locust's event hooks are untyped
def _start(environment: Any, **_: Any) -> None:
    global _out, _ready
    opts = environment.parsed_options
    users.FEED, _ready = _ready or _feed(opts), None
    if opts.requests_out and _out is None:
        Path(opts.requests_out).parent.mkdir(parents=True, exist_ok=True)
        # line-buffered, open to the process's end: requests that finish while Locust stops (it counts
        # them) are recorded too
        _out = open(opts.requests_out, "a", buffering=1)   # noqa: SIM115 (open for the whole test)
        atexit.register(_out.close)


def _schedule(workload: Any, opts: Any) -> Iterator[float] | None:
    """The open loop's send times (seconds from the start); None for closed-loop users."""
    if opts.time_scale > 0:
        return workload.offsets(opts.time_scale)   # type: ignore[no-any-return]  # the trace workload's
    if opts.stages:
        return send_times(parse(opts.stages), opts.arrival, opts.seed)
    if opts.rate > 0:
        return itertools.accumulate(arrival(opts.rate, opts.arrival).gaps(opts.seed), initial=0.0)
    return None


@events.test_stop.add_listener  # type: ignore[untyped-decorator]  # locust's event hooks are untyped
def _stop(environment: Any, **_: Any) -> None:
    """Open-loop requests still running at the end are recorded, as errors, not dropped."""
    if users.FEED is not None and _out is not None:
        for record in users.FEED.unfinished():
            _out.write(json.dumps(msgspec.to_builtins(record)) + "\n")


@events.request.add_listener  # type: ignore[untyped-decorator]  # locust's event hooks are untyped
def _record(context: dict[str, Any] | None = None, **_: Any) -> None:
    record = (context or {}).get("kvlab_record")
    if record is not None and _out is not None:
        _out.write(json.dumps(record) + "\n")
