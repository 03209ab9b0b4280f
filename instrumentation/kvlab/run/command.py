"""How a long-running kvlab command ends: one shape for its errors and its interruption.

`kvlab lab`, `kvlab calibrate` and `kvlab bench` print a failure as `kvlab <command>: <message>`
in red (exit 1; the message is never read as rich markup) and an interruption as one yellow line
(exit 130), after their stacks have stopped themselves.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console

from kvlab.errors import KvlabError


def fail(console: Console, command: str, message: object) -> int:
    """Print `kvlab <command>: <message>` as an error; returns the exit code 1."""
    console.print(f"kvlab {command}: {message}", style="red", markup=False)
    return 1


def guarded(console: Console, command: str, action: Callable[[], object], interrupted: str) -> int:
    """Run `action`: 0 when it returns, 1 on a KvlabError/ValueError, 130 on Ctrl-C."""
    try:
        action()
    except (KvlabError, ValueError) as exc:
        return fail(console, command, exc)
    except KeyboardInterrupt:
        console.print(f"interrupted; {interrupted}", style="yellow", markup=False)
        return 130
    return 0
