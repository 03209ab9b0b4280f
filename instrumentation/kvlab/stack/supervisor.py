"""The detached process behind `kvlab up`: runs a LocalStack until SIGTERM/SIGINT, then stops it.

`python -m kvlab.stack.supervisor --run-dir DIR --topology FILE` (started by `kvlab up`). It
records its pid and argv in stack.json (`supervisor`), watches its children and marks the stack
`degraded` in stack.json (and its log) when one exits unexpectedly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.stack.local import LocalStack
from kvlab.topology import load_topology


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlab.stack.supervisor")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--topology", required=True, type=Path)
    args = p.parse_args(argv)
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    stack = LocalStack(load_topology(args.topology), args.run_dir)
    cmdline = [c.decode() for c in Path("/proc/self/cmdline").read_bytes().split(b"\0") if c]
    stack.extra["supervisor"] = {"pid": os.getpid(), "argv": cmdline}
    try:
        stack.start()
        print(f"stack running: gateway {stack.gateway_url}", flush=True)
        reported: set[str] = set()
        while not stopping:
            dead = [c for c in stack.children if not c.alive() and c.name not in reported]
            for c in dead:
                print(f"{c.name} (pid {c.pid}) exited; see {c.log}", flush=True)
                reported.add(c.name)
                stack.write_state("degraded")
            time.sleep(0.5)
    except KvlabError as exc:
        print(f"kvlab up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()
        print("stack stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
