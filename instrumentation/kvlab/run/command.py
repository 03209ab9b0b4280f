"""How a long-running kvlab command ends: one shape for its errors and its interruption.

`kvlab lab`, `kvlab compare` and `kvlab calibrate` print a failure as `kvlab <command>: <message>`
in red (exit 1; the message is never read as rich markup) and an interruption (Ctrl-C, or SIGTERM
as `kill` and `kvlab down` send it) as one yellow line (exit 130), after their stacks have stopped
themselves.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from rich.console import Console

from kvlab.errors import KvlabError


def fail(console: Console, command: str, message: object) -> int:
    """Print `kvlab <command>: <message>` as an error; returns the exit code 1."""
    console.print(f"kvlab {command}: {message}", style="red", markup=False, soft_wrap=True)   # one line in a log
    return 1


def guarded(console: Console, command: str, action: Callable[[], object], interrupted: str) -> int:
    """Run `action`: 0 when it returns, 1 on a KvlabError/ValueError, 130 on Ctrl-C or SIGTERM (which
    would otherwise end Python without running the `finally` blocks that stop its processes)."""
    with signals_handled(_interrupt, signal.SIGTERM):
        try:
            action()
        except (KvlabError, ValueError) as exc:
            return fail(console, command, exc)
        except KeyboardInterrupt:
            console.print(f"interrupted; {interrupted}", style="yellow", markup=False)
            return 130
    return 0


@contextlib.contextmanager
def signals_handled(handler: Callable[[int, FrameType | None], None], *signums: int) -> Iterator[None]:
    """`handler` for `signums` inside the block, the previous handlers after it; off the main thread
    (where Python takes no signal) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {n: signal.signal(n, handler) for n in signums}
    try:
        yield
    finally:
        for n, h in previous.items():
            signal.signal(n, h)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
