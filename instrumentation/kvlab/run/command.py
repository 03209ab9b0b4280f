"""How a long-running kvlab command ends: one shape for its errors and its interruption.

`kvlab lab`, `kvlab compare` and `kvlab calibrate` print a failure as `kvlab <command>: <message>`
in red (exit 1; the message is never read as rich markup) and an interruption (Ctrl-C, or SIGTERM
as `kill` and `kvlab down` send it) as one yellow line (exit 130), after their stacks have stopped
themselves.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
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
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        action()
    except (KvlabError, ValueError) as exc:
        return fail(console, command, exc)
    except KeyboardInterrupt:
        console.print(f"interrupted; {interrupted}", style="yellow", markup=False)
        return 130
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
