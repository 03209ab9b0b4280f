"""The `kvlab` command.

Each sub-command lives in the package that owns it and is imported only when used, so
`kvlab --help` and short commands start fast. A sub-command module exposes
`main(argv: list[str]) -> int` and parses its own flags.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). Keep in the order a learner meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("kvlab.doctor", "what this machine has (CPU ISA, cores, optional parts) and what the lab picks"),
    "lab": ("kvlab.lab", "run the before/after lab: cache-blind vs KV-aware (what `make lab` runs)"),
    "compare": ("kvlab.compare.command", "the same replicas and workload through several routers, peers too"),
    "up": ("kvlab.stack.cli", "start a local stack (replicas, gateway, telemetry) from a topology"),
    "status": ("kvlab.stack.cli", "show the local stack's processes and health"),
    "down": ("kvlab.stack.cli", "stop the local stack"),
    "bench": ("kvlab.load.cli", "run a Locust workload headless against a target"),
    "engine": ("kvlab.engine.cli", "run a model server: `engine sim` or `engine vllm`"),
    "gateway": ("kvlab.gateway.cli", "run the instrumented KV-aware gateway"),
    "epp": ("kvlab.epp.cli", "kvlab's scheduler as a Gateway API endpoint picker (Envoy ext_proc gRPC)"),
    "tokenize": ("kvlab.gateway.tokenize", "print the token ids the gateway routes on (parity check)"),
    "model": ("kvlab.engine.model", "build a tiny local model for real vLLM on CPU"),
    "twin": ("kvlab.twin.cli", "the cluster twin: kvlab's router on 1-128 simulated replicas in virtual time"),
    "plan": ("kvlab.plan.cli", "how many replicas (GPUs) each routing policy needs to meet an SLO, from the twin"),
    "calibrate": ("kvlab.calibration.cli", "fit a simulator profile to this machine's real vLLM (`--profile local`)"),
    "report": ("kvlab.report.saved", "render a run's report.html (and compare.html) again from its saved files"),
    "traces": ("kvlab.traces.cli", "list, show and explain traces of a run"),
    "dashboards": ("kvlab.dashboards", "write the Grafana dashboards to dashboards/"),
    "cluster": ("kvlab.stack.kind",
                "the kind cluster path: create, deploy, render, preflight, status, forward, delete"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: kvlab <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`kvlab <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from kvlab import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvlab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    # modules that serve several top-level commands (up/status/down) get the name first
    if getattr(module, "MULTI_COMMAND", False):
        return int(module.main([name, *rest]) or 0)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
