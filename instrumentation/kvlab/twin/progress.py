"""A twin run's progress: a rich bar per policy on a terminal (requests done, virtual time,
requests/s, ETA), a plain line every few seconds in a log (stderr not a terminal)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LINE_EVERY_S = 5.0   # a plain line this often in a log


class RunProgress:
    """`with RunProgress(console) as p: run(plan, progress=p.task(name, total))`."""

    def __init__(self, console: Console, every_s: float = LINE_EVERY_S) -> None:
        self.console = console
        self.every_s = every_s
        self.bar = (Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                             TextColumn("{task.fields[virtual]} virtual · {task.fields[rate]} req/s"),
                             TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console)
                    if console.is_terminal else None)

    def __enter__(self) -> RunProgress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.__exit__(kind, exc, tb)

    def task(self, name: str, total: int) -> Callable[[int, float], None]:
        """The callback a run calls with (requests done, virtual seconds)."""
        start = time.monotonic()
        last = [start]
        bar = self.bar
        task = bar.add_task(name, total=total, virtual="0 s", rate="–") if bar is not None else None

        def update(done: int, virtual_s: float) -> None:
            now = time.monotonic()
            if bar is not None and task is not None:
                if done % 50 == 0 or done >= total:
                    bar.update(task, completed=done, virtual=_duration(virtual_s),
                               rate=f"{done / max(now - start, 1e-9):,.0f}")
                return
            if now - last[0] >= self.every_s or done >= total:
                last[0] = now
                rate = done / max(now - start, 1e-9)
                eta = f"{(total - done) / rate:,.0f} s" if rate > 0 and done < total else "–"
                self.console.print(f"{name}: {done:,}/{total:,} requests · {_duration(virtual_s)} virtual · "
                                   f"{rate:,.0f} req/s · {now - start:,.0f} s elapsed · ETA {eta}",
                                   soft_wrap=True, highlight=False)
        return update


def _duration(s: float) -> str:
    return f"{s:,.0f} s" if s < 3600 else f"{s / 3600:,.1f} h"
