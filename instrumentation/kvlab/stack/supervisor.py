"""The detached process behind `kvlab up`: runs a LocalStack until SIGTERM/SIGINT, then stops it.

`python -m kvlab.stack.supervisor --run-dir DIR --topology FILE` (started by `kvlab up`). It
records its pid and argv in stack.json (`supervisor`) and watches its children: one that exits is
started again with the same argv (engines keep their ports), at once the first time and then after
1, 2, 4 ... up to 30 s of back-off; a child that stayed up for a minute starts over at no delay.
Each restart is a line in its log and a `stack.restart` span; stack.json says `degraded` while a
child is down, `running` again once all are up.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.process import own_record
from kvlab.stack.local import LocalStack
from kvlab.topology import load_topology

BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0


class Restarter:
    """Restarts dead children of a stack with back-off (BACKOFF_S by consecutive restarts)."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.restarts: dict[str, int] = {}      # consecutive restarts per child name
        self.due: dict[str, float] = {}         # when the next restart of a dead child may happen
        self.started: dict[str, float] = {}     # when each restarted child was last started

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for name, t in list(self.started.items()):
            if now - t >= STABLE_S:              # it stayed up: the next failure restarts at once
                self.restarts.pop(name, None)
                self.started.pop(name)
        dead = [c for c in self.stack.children if not c.alive()]
        for c in dead:
            n = self.restarts.get(c.name, 0)
            if c.name not in self.due:
                code = c.proc.poll() if c.proc is not None else None
                delay = BACKOFF_S[min(n, len(BACKOFF_S) - 1)]
                self.due[c.name] = now + delay
                print(f"{c.name} (pid {c.pid}) exited with code {code}; restart {n + 1} in {delay:g} s "
                      f"(see {c.log})", flush=True)
                self.stack.write_state("degraded")
            if now >= self.due[c.name]:
                new = self.stack.restart(c, n + 1)
                del self.due[c.name]
                self.restarts[c.name] = n + 1
                self.started[c.name] = now
                print(f"{c.name} restarted (pid {new.pid})", flush=True)
        if dead and all(c.alive() for c in self.stack.children):
            self.stack.write_state("running")


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
    stack.supervisor = own_record("supervisor", str(Path(args.run_dir).absolute() / "supervisor.log"))
    try:
        stack.start()
        print(f"stack running: gateway {stack.gateway_url}", flush=True)
        restarter = Restarter(stack)
        while not stopping:
            restarter.check()
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
