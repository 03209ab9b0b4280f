"""Independent runs side by side, one forked process each: the policies of a `kvlab twin`
comparison, the per-policy searches of `kvlab plan`.

A twin run is one core's work from its start to its end (one event loop in virtual time), and the
policies of a comparison never share state: on a machine with two cores, `--policies
round-robin,kv-aware` takes about as long as its slower policy, not as long as both. Each item's
work is forked (the plans, the parsed trace and everything already imported come along), sends
its reports (progress, a probe) through a pipe as it goes, and its value at the end; the figures
are those the same work gives in this process. Ctrl-C or SIGTERM is noted, not raised, and sent
on to every process still working (each acts on the first signal it gets), which then sends what
it has; a process that dies (the out-of-memory killer) is reported with its exit code, never
waited on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkProcess
from types import FrameType
from typing import Any, TypeVar, cast

from kvlab.errors import ConfigError, TwinError
from kvlab.run.command import signals_handled

T = TypeVar("T")
Report = Callable[[Any], None]
REPORT_EVERY_S = 0.1    # how often a run's progress is sent (and the pipes are checked for a stop)
MAX_DEFAULT_JOBS = 4    # each process holds its own memory (16 x 10,000 conversation requests: ~0.8 GB)
_FORKS = "fork" in multiprocessing.get_all_start_methods()   # not on Windows


class Interrupt(BaseException):
    """Raised into the work by a signal handler (SIGTERM) to stop it where it is. Like
    KeyboardInterrupt, not an Exception: the signal can land inside code that takes any Exception
    for its own error (the chat template's rendering answers it with a 400)."""


def default_jobs() -> int:
    """Processes at once unless told: one per core this process may run on, at most
    `MAX_DEFAULT_JOBS` (1 where processes cannot be forked)."""
    if not _FORKS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, MAX_DEFAULT_JOBS)


@dataclass(slots=True)
class Ended:
    """What the work left: each item's value by index, the items whose process died without one
    (its exit code), the items that raised rather than stop when told to (what they raised), and
    the Ctrl-C or SIGTERM that stopped this command (None: none did)."""

    values: dict[int, Any] = field(default_factory=dict)
    died: dict[int, int | None] = field(default_factory=dict)
    raised: dict[int, str] = field(default_factory=dict)
    signal: int | None = None

    def cut_short(self, name: Callable[[int], str]) -> tuple[str, BaseException] | None:
        """Why the work ended early, and the exception that stands for it: the signal that stopped
        this command (and each item, named by `name(index)`, whose part it lost), else the first
        item whose process died; None: neither."""
        if self.signal is not None:
            cause = stopped_by(self.signal)
            lost = [f"the {name(i)} run ended without a result (exit code {code})" for i, code in self.died.items()]
            lost += [f"the {name(i)} run raised {what} instead of stopping" for i, what in self.raised.items()]
            return "; ".join([f"stopped by {type(cause).__name__}", *lost]), cause
        for i, code in self.died.items():
            why = f"the {name(i)} run ended without a result (exit code {code})"
            return why, TwinError(why)
        return None


@dataclass(slots=True)
class _Proc:
    index: int
    process: ForkProcess
    conn: Connection


def side_by_side(items: Sequence[T], work: Callable[[T, Report], Any], on_report: Callable[[int, Any], None],
                 jobs: int, on_value: Callable[[int, Any], bool] = lambda i, v: True,
                 label: Callable[[T], str] = str) -> Ended:
    """`work(item, report)` for every item, `jobs` at a time in processes of their own (1, or no
    fork on this platform: one after another in this process, its exceptions raised as they are);
    `on_report(index, what)` for each report, `on_value(index, value)` for each value (False: start
    no further item). A process's exception is raised here (ConfigError and TwinError as such, any
    other a RuntimeError naming the item by `label` with its traceback) unless this command was stopped."""
    ended = Ended()
    if jobs <= 1 or len(items) <= 1 or not _FORKS:
        for i, item in enumerate(items):
            ended.values[i] = value = work(item, lambda what, i=i: on_report(i, what))   # type: ignore[misc]
            if not on_value(i, value):
                break
        return ended
    ctx = multiprocessing.get_context("fork")
    todo = list(enumerate(items))
    procs: dict[Connection, _Proc] = {}
    stop: list[int] = []
    forwarded, more = False, True
    try:
        with _signals_noted(stop):
            while procs or (todo and more and not stop):
                while todo and more and len(procs) < jobs and not stop:
                    i, item = todo.pop(0)
                    reader, writer = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_child, args=(writer, work, item), daemon=True)
                    proc.start()
                    writer.close()   # the child's end: its exit is the reader's EOF
                    procs[reader] = _Proc(i, proc, reader)
                if stop and not forwarded:
                    forwarded = True   # a terminal's Ctrl-C reached them already; they act on one
                    for p in procs.values():
                        os.kill(cast(int, p.process.pid), signal.SIGTERM)
                for conn in wait(list(procs), timeout=REPORT_EVERY_S) if procs else ():
                    p = procs[conn]   # type: ignore[index]   # wait() returns what it was given
                    try:
                        msg = p.conn.recv()
                    except EOFError:   # the process ended without sending its value
                        _end(procs, p)
                        ended.died[p.index] = p.process.exitcode
                        continue
                    if msg[0] == "report":
                        on_report(p.index, msg[1])
                        continue
                    _end(procs, p)
                    if msg[0] == "value":
                        ended.values[p.index] = msg[1]
                        more = on_value(p.index, msg[1]) and more
                    elif not stop:
                        raise _raised(label(items[p.index]), *msg[1:])
                    elif msg[1] not in _STOPS:   # told to stop, it failed instead: its part is lost, and said so
                        ended.raised[p.index] = f"{msg[1]}: {msg[2]}"
    finally:
        for p in procs.values():   # only after a second Ctrl-C or a failed item
            p.process.kill()
            p.process.join()
            p.conn.close()
    ended.signal = stop[0] if stop else None
    return ended


def stopped_by(signum: int) -> BaseException:
    """The exception a signal stands for (the exit code follows it: 130 or 143)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupt("SIGTERM")


def _signals_noted(stop: list[int]) -> contextlib.AbstractContextManager[None]:
    """Ctrl-C and SIGTERM are noted in `stop`, not raised, so no read of a pipe is cut in two; a
    second one raises (the processes are then killed, their values lost). A Ctrl-C this process
    ignores (started in the background) stays ignored."""
    def note(signum: int, frame: FrameType | None) -> None:
        if stop:
            raise stopped_by(signum)
        stop.append(signum)

    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    return signals_handled(note, signal.SIGTERM, *(() if ignored else (signal.SIGINT,)))


_STOPS = ("Stopped", "KeyboardInterrupt", "Interrupt")   # what work raises when it stops as told


def _raised(label: str, kind: str, message: str, trace: str) -> Exception:
    if kind == "ConfigError":
        return ConfigError(message)
    if kind == "TwinError" or kind in _STOPS:
        return TwinError(message or f"stopped by {kind}")
    return RuntimeError(f"the {label} run failed:\n{trace}")


def _end(procs: dict[Connection, _Proc], p: _Proc) -> None:
    del procs[p.conn]
    p.conn.close()
    p.process.join()


def _child(conn: Connection, work: Callable[[Any, Report], Any], item: Any) -> None:
    """One item's work in its own process: its reports, then ("value", what it returned) or
    ("raised", the exception's class name, message and traceback)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # forked after the parent tokenized: no pool here
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _first_signal)
    signal.signal(signal.SIGTERM, _first_signal)
    try:
        msg: tuple[Any, ...]
        try:
            msg = ("value", work(item, lambda what: conn.send(("report", what))))
        except BaseException as exc:   # sent whole; the parent decides what it means
            msg = ("raised", type(exc).__name__, str(exc), traceback.format_exc())
        _ignore_signals()
        conn.send(msg)
    finally:
        conn.close()


def _first_signal(signum: int, frame: FrameType | None) -> None:
    """Stop the work on the first Ctrl-C or SIGTERM; ignore the rest (the parent forwards one too)."""
    _ignore_signals()
    raise stopped_by(signum)


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
