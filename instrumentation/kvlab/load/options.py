"""The open-loop and trace-replay options `kvlab bench`, `kvlab lab` and `kvlab compare` share.

`--rate R` (or `--rates R1,R2,...`, a sweep: one phase per rate) sends requests at that rate with
`--arrival poisson|constant|gamma:CV`, instead of closed-loop `--users`; `--trace NAME|FILE`
replays a Mooncake trace (at its own timestamps times `--time-scale`, or scaled to `--rate`),
its lengths times `--token-scale`; `--slo-ttft` / `--slo-tpot` set the goodput SLO. Everything is
checked here, before any process starts (docs/open-loop.md).
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from kvlab.errors import ConfigError
from kvlab.load.arrival import PROCESSES, arrival, rates
from kvlab.load.spec import BenchSpec
from kvlab.load.stages import parse
from kvlab.load.summary import Slo
from kvlab.load.workloads.trace import NAMED, resolve


def add_arguments(p: argparse.ArgumentParser, sweep: bool = True) -> None:
    """The open-loop options (`sweep`: with --rates)."""
    g = p.add_argument_group("open loop and trace replay (docs/open-loop.md)")
    g.add_argument("--rate", type=float, help="open loop: send this many requests/s, whether or not earlier ones "
                                              "finished (instead of --users)")
    if sweep:
        g.add_argument("--rates", help="open loop, a sweep: comma-separated requests/s, one phase per rate")
    g.add_argument("--stages", help="open loop, a stepped ramp: RATE:SECONDS,... (inference-perf's stages; "
                                    "per-stage results in summary.json)")
    g.add_argument("--arrival", help=f"open loop: the arrival process, {' | '.join(PROCESSES)} (default poisson)")
    g.add_argument("--trace", help=f"replay a Mooncake JSONL trace: {' | '.join(NAMED)} or a file")
    g.add_argument("--time-scale", type=float, help="--trace: its timestamps times this (default 1; 2 = half the "
                                                    "rate); --rate scales them to that mean rate instead")
    g.add_argument("--token-scale", type=float, help="--trace: prompt and output lengths times this (default 1)")
    g.add_argument("--slo-ttft", type=float, default=Slo().ttft_ms,
                   help="goodput SLO: time to first token, ms (default %(default)g)")
    g.add_argument("--slo-tpot", type=float, default=Slo().tpot_ms,
                   help="goodput SLO: time per output token, ms (default %(default)g)")


def _rates(args: argparse.Namespace) -> list[float] | None:
    given = getattr(args, "rates", None)
    if args.rate is not None and given:
        raise ConfigError("give --rate or --rates, not both")
    if given:
        return rates(given)
    if args.rate is not None:
        arrival(args.rate)   # > 0
        return [args.rate]
    return None


def check(args: argparse.Namespace) -> None:
    """Every open-loop mistake, as a ConfigError, before anything starts."""
    sweep = _rates(args)
    if sweep and args.users is not None:
        raise ConfigError("--rate/--rates send at a rate (open loop); --users runs closed-loop users: give one")
    if getattr(args, "stages", None):
        if sweep or args.users is not None or args.trace:
            raise ConfigError("--stages is an open-loop ramp: not with --rate/--rates, --users or --trace")
        parse(args.stages)
    if args.arrival is not None and not getattr(args, "stages", None):
        if not sweep:
            raise ConfigError("--arrival needs --rate or --rates")
        if args.trace:
            raise ConfigError("--arrival does not apply to --trace: a trace keeps its own arrival times "
                              "(--rate scales them)")
        arrival(sweep[0], args.arrival)
    for flag, value in (("--time-scale", args.time_scale), ("--token-scale", args.token_scale)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be > 0 (got {value:g})")
        if value is not None and not args.trace:
            raise ConfigError(f"{flag} applies to --trace")
    if args.time_scale is not None and (sweep or args.users is not None):
        raise ConfigError("--time-scale replays a trace at its own timing: not with --rate/--rates or --users")
    if args.trace and getattr(args, "workload", None):
        raise ConfigError("--trace is the workload: not with --workload")
    for flag, value in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0 ms (got {value:g})")


def trace_workload(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    """("trace", its parameters) for --trace (the file checked and parsed now), else None."""
    if not args.trace:
        return None
    from kvlab.load.workloads.trace import Trace

    params = {"path": str(resolve(args.trace)), "token_scale": args.token_scale or 1.0}
    Trace(params=params)   # parsed now: a bad line fails before anything starts
    return "trace", params


def specs(args: argparse.Namespace, spec: BenchSpec) -> list[BenchSpec]:
    """`spec` as the options make it: one per rate of a sweep; a trace without a rate or users
    replays its own timing; else `spec` itself (closed-loop users). Run `check` first."""
    slo = Slo(ttft_ms=args.slo_ttft, tpot_ms=args.slo_tpot)
    sweep = _rates(args)
    if getattr(args, "stages", None):
        stages = parse(args.stages)
        return [msgspec.structs.replace(spec, stages=stages, duration_s=sum(s.duration for s in stages), slo=slo,
                                        users=1, arrival=None)]
    if sweep:
        return [msgspec.structs.replace(spec, arrival=arrival(r, args.arrival or "poisson"), slo=slo, users=1)
                for r in sweep]
    if spec.workload == "trace" and args.users is None:
        return [msgspec.structs.replace(spec, time_scale=args.time_scale or 1.0, slo=slo, users=1)]
    return [msgspec.structs.replace(spec, slo=slo)]
