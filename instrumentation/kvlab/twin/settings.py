"""What a twin run is, typed and checked once before anything runs (`resolve`).

`Information` is what the router sees of the replicas, each part a setting whose default is the
live stack's: KV events reach the gateway's index a little after the engine step that stored the
blocks; the load view (queue, running, KV usage) is a scrape every 200 ms; speculative blocks live
for the policy's TTL; tokenizing a prompt takes time before it is routed. `perfect: true` switches
every lag off: the router's upper bound.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvlab.config import Strict
from kvlab.engine.sim.length import check_cache
from kvlab.engine.sim.profile import LatencyProfile, get_profile
from kvlab.errors import ConfigError
from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.scheduler.epp import load, policy_of
from kvlab.load.arrival import Arrival, arrival
from kvlab.load.stages import Stage, bound
from kvlab.load.workloads import Workload, create
from kvlab.topology import SimSettings, Topology, builtin, load_topology
from kvlab.twin.fit import Fit, request_lengths, roomiest_profile

NonNegative = Annotated[float, msgspec.Meta(ge=0)]
MAX_REPLICAS = 128
MIN_SCRAPE_MS = 1.0   # the finest load-view scrape interval (0, always fresh, is the limit of finer ones)


class Information(Strict, frozen=True):
    """What the router sees, and how late (defaults: the live stack's, docs/twin.md)."""

    # engine step end -> blocks in the gateway's precise index: ZMQ publish, the gateway's
    # subscriber task and `PreciseIndex.apply` on a local machine take about a millisecond
    kv_event_delay_ms: NonNegative = 1.0
    # >0: events are held and applied in windows of this length (a batching publisher); 0: one
    # batch per engine step, as vLLM and the simulator publish
    kv_event_batch_ms: NonNegative = 0.0
    # the gateway's load view (waiting, running, KV usage) is scraped this often
    # (GatewaySettings.scrape_interval_ms, gateway/loadview.py); 0: always fresh
    scrape_interval_ms: NonNegative = 200.0
    # speculative blocks' TTL; None: the policy's own `index.speculative_ttl_s` (30 s); 0: off
    speculative_ttl_s: NonNegative | None = None
    # gateway tokenization before routing, per 1,000 prompt tokens: 0.41 ms p50 for an 8k-token
    # prompt with its document cached (docs/benchmarks.md, "Tokenization")
    tokenize_ms_per_1k: NonNegative = 0.05
    # fixed cost between a client's send and the engine queue: the gateway's added latency, 0.71 ms
    # p50 (docs/benchmarks.md, "What does the gateway cost?"), plus loopback hops
    request_overhead_ms: NonNegative = 1.0
    perfect: bool = False   # every lag above off: events instant, load view fresh, no tokenize cost

    def effective(self) -> Information:
        """These settings with `perfect` applied."""
        if not self.perfect:
            return self
        return Information(kv_event_delay_ms=0.0, kv_event_batch_ms=0.0, scrape_interval_ms=0.0,
                           speculative_ttl_s=self.speculative_ttl_s, tokenize_ms_per_1k=0.0,
                           request_overhead_ms=0.0, perfect=True)


class TwinSettings(Strict, frozen=True):
    """One twin run (`kvlab twin` flags, or a YAML file of these keys)."""

    topology: str = "quickstart"          # a shipped name or a path
    policy: str | None = None             # None: the topology's gateway policy
    epp_config: str | None = None         # an llm-d/GIE EndpointPickerConfig file instead of a policy
    replicas: int | None = None           # None: the topology's replicas
    profile: str | None = None            # None: the topology's sim profile
    num_blocks: int | None = None         # KV blocks per replica; None: the topology's / profile's
    max_model_len: Annotated[int, msgspec.Meta(ge=1)] | None = None   # None: the topology's / profile's
    block_size: int | None = None         # tokens per KV block; None: the topology's / profile's
    workload: str | None = None           # None: the topology's workload
    workload_params: dict[str, Any] = msgspec.field(default_factory=dict)
    trace: str | None = None              # a Mooncake trace (name or path): the trace workload
    requests: Annotated[int, msgspec.Meta(ge=1)] = 1000
    # also stop sending after this many (virtual) seconds, as a live phase's run time does
    duration_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    users: Annotated[int, msgspec.Meta(ge=1)] | None = None    # closed loop (default without rate/trace: 8)
    rate: Annotated[float, msgspec.Meta(gt=0)] | None = None   # open loop, requests/s
    arrival: str = "poisson"              # poisson | constant | gamma:CV (with rate)
    # a stepped ramp (load/stages.py), warm-up stages first; it decides how many requests are sent
    stages: list[Stage] = msgspec.field(default_factory=list)
    time_scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0     # a trace's timestamps times this
    seed: int = 0
    information: Information = Information()


@dataclass(frozen=True, slots=True)
class Member:
    """One endpoint the gateway routes to, named and labelled as `kvlab engine sim` does."""

    name: str
    role: str                  # both | prefill | decode
    replica: str | None = None  # the data-parallel replica it is a rank of (None: it is the replica)
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a run needs, resolved and validated."""

    settings: TwinSettings
    topology: Topology
    policy: PolicyConfig
    profile: LatencyProfile
    profile_name: str
    sim: SimSettings                      # engine sizes: the topology's, or the profile's when it was named
    replicas: int                         # endpoints: each rank of a data-parallel replica counts
    members: list[Member]
    num_blocks: int
    workload: Workload[Any]
    arrival: Arrival | None               # open loop at a rate
    users: int | None                     # closed loop
    trace_timing: bool                    # open loop at the trace's own timestamps
    information: Information
    max_model_len: int = 0                # longer requests (prompt + max_tokens) are answered 400; 0: no limit
    fit: Fit | None = None                # a trace's requests against max_model_len (twin/fit.py)
    profile_reason: str | None = None     # why the profile was chosen, when no one named it
    stages: list[Stage] = dataclasses.field(default_factory=list)   # a stepped ramp (open loop)


def resolve(s: TwinSettings) -> Plan:
    """Check every setting and build the run's parts, or raise a ConfigError saying what is wrong."""
    topo = load_topology(s.topology if s.topology.endswith((".yaml", ".yml")) else builtin(s.topology))
    members = layout(topo, s.replicas)
    replicas = len(members)
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"replicas must be between 1 and {MAX_REPLICAS} (got {replicas})")
    policy = (policy_of(s.epp_config) if s.epp_config
              else load(s.policy or topo.gateway.policy, topo.gateway.config))
    if s.trace is not None:
        wname, params = "trace", {**s.workload_params, "path": s.trace}
    else:
        wname = s.workload or topo.workload.name
        params = s.workload_params if s.workload else {**topo.workload.params, **s.workload_params}
    try:
        workload = create(wname, s.seed, params)
    except ValueError as exc:   # a parameter check in a workload's __post_init__
        raise ConfigError(f"workload {wname}: {exc}") from None
    lengths = request_lengths(workload, s.requests)
    name, reason = s.profile or topo.sim.profile, None
    if lengths is not None and s.profile is None and s.max_model_len is None:
        longest = lengths.longest
        if longest > topo.sim.max_model_len:   # the topology's profile does not hold them all
            other, held = roomiest_profile(lengths)
            own = lengths.requests - Fit(lengths, topo.sim.max_model_len).over
            if held == lengths.requests:
                name, reason = other, (f"the first shipped profile that holds the trace's longest request "
                                       f"({longest:,} tokens; {topo.name}'s {topo.sim.profile} takes "
                                       f"{topo.sim.max_model_len:,})")
            elif held > own:   # none holds them all: the one that holds the most
                name, reason = other, (f"the shipped profile that holds the most of the trace's requests ({held:,} "
                                       f"of {lengths.requests:,}; none holds the longest, {longest:,} tokens; "
                                       f"{topo.name}'s {topo.sim.profile} holds {own:,})")
    profile = get_profile(name)
    sim = topo.sim
    if name != topo.sim.profile:   # another engine: its own sizes
        sim = msgspec.structs.replace(sim, profile=name, block_size=profile.block_size, num_blocks=None,
                                      max_num_seqs=profile.max_num_seqs,
                                      max_num_batched_tokens=profile.max_num_batched_tokens,
                                      max_model_len=profile.max_model_len, time_scale=1.0)
    if s.block_size is not None:
        if s.block_size < 1:
            raise ConfigError(f"block_size must be >= 1 (got {s.block_size})")
        # the same KV memory in blocks of another size
        tokens = (sim.num_blocks or profile.num_blocks) * sim.block_size
        sim = msgspec.structs.replace(sim, block_size=s.block_size, num_blocks=max(1, tokens // s.block_size))
    blocks = s.num_blocks or sim.num_blocks or profile.num_blocks
    if blocks < 1:
        raise ConfigError(f"num_blocks must be >= 1 (got {blocks})")
    max_len = s.max_model_len or sim.max_model_len
    check_cache(max_len, blocks, sim.block_size)
    if s.users is not None and s.rate is not None:
        raise ConfigError("give users (closed loop) or rate (open loop), not both")
    if s.stages and (s.users is not None or s.rate is not None or s.trace is not None):
        raise ConfigError("stages are an open-loop ramp: give stages, or users, or a rate, or a trace")
    if s.stages:
        if s.arrival not in ("poisson", "constant"):
            raise ConfigError(f"stages send poisson or constant arrivals (got {s.arrival!r})")
        s = msgspec.structs.replace(s, requests=bound(s.stages))
    scrape = s.information.scrape_interval_ms
    if 0 < scrape < MIN_SCRAPE_MS:   # a scrape is an event: a finer one would crawl through virtual time
        raise ConfigError(f"scrape_interval_ms must be 0 (always fresh) or at least {MIN_SCRAPE_MS:g} ms "
                          f"(got {scrape:g})")
    trace_timing = wname == "trace" and s.users is None and s.rate is None
    rate = arrival(s.rate, s.arrival) if s.rate is not None else None
    users = s.users if s.users is not None else (None if rate or trace_timing or s.stages else 8)
    return Plan(s, topo, policy, profile, name, sim, replicas, members, blocks, workload, rate, users, trace_timing,
                s.information.effective(), max_len, Fit(lengths, max_len) if lengths is not None else None, reason,
                list(s.stages))


def layout(topo: Topology, replicas: int | None) -> list[Member]:
    """Every endpoint of the topology, `replicas` replicas in all (None: the topology's). A P/D
    topology keeps its pools' ratio, so `replicas` must be a multiple of its smallest form (pd's
    2 prefill + 2 decode pools of one: a multiple of 4); a data-parallel replica counts once and
    brings its `data_parallel_size` ranks. One pool's replicas are `sim-I` (`sim-I-dpR`), as the
    twin has always named them; several pools' are named as `kvlab up` names them."""
    ps = [p for p in topo.pools if p.replicas]
    counts = [p.replicas for p in ps]
    if replicas is not None and replicas != sum(counts):
        if len(ps) == 1:
            counts = [replicas]
        else:
            unit = sum(counts) // math.gcd(*counts)
            if replicas < 1 or replicas % unit:
                raise ConfigError(f"topology {topo.name}: --replicas must be a multiple of {unit} to keep its pools' "
                                  f"ratio ({', '.join(f'{p.name}: {p.replicas}' for p in ps)}) (got {replicas})")
            counts = [c * replicas // sum(counts) for c in counts]
    out: list[Member] = []
    for p, n in zip(ps, counts):
        dp = p.data_parallel_size
        for i in range(n):
            base = f"sim-{i}" if len(ps) == 1 else (p.name if n == 1 else f"{p.name}-{i}")
            for r in range(dp):
                if dp == 1:
                    out.append(Member(base, p.role))
                else:
                    out.append(Member(f"{base}-dp{r}", p.role, base, r))
    return out
