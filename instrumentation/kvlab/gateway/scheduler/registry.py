"""Scheduler plug-ins by name. A filter, a scorer or a picker is one class in one module,
registered with `@plugin`; its name is what a policy file says (a scorer's name is also its
field in `weights:`, a picker's the value of `picker:`). `presets.build` assembles a policy from
these tables; `scheduler/__init__.py` imports the modules, in the order their scores are shown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvlab.gateway.scheduler.base import Filter, Picker, Scorer

FILTERS: dict[str, type[Filter]] = {}
SCORERS: dict[str, type[Scorer]] = {}
PICKERS: dict[str, type[Picker]] = {}

P = TypeVar("P", bound=Filter | Scorer | Picker)


def plugin(cls: type[P]) -> type[P]:
    """Register a plug-in class under its `name` (a second class with that name is a bug)."""
    table: dict[str, type] = (FILTERS if issubclass(cls, Filter) else SCORERS if issubclass(cls, Scorer)
                              else PICKERS)
    if cls.name in table:
        raise ValueError(f"two scheduler plug-ins are named {cls.name!r}: {table[cls.name]} and {cls}")
    table[cls.name] = cls
    return cls


def named(table: dict[str, type[P]], kind: str) -> Callable[[str], type[P]]:
    def get(name: str) -> type[P]:
        try:
            return table[name]
        except KeyError:
            raise ValueError(f"no {kind} named {name!r}; known: {', '.join(sorted(table))}") from None
    return get
