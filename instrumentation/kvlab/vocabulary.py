"""One name per thing across kvlab's commands: `--policies` for the routers a run compares,
`--run-dir` for where a run writes, `--workload-params` for workload parameters. An older spelling
still parses for a release, unlisted in --help."""

from __future__ import annotations

import argparse
from typing import Any

# the flags each spelling moved to: tests/test_cli_vocabulary.py checks no command lists them
RETIRED = ("--routers", "--out", "--params", "--run")


def old_spelling(p: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str, **kw: Any) -> None:
    """`old` parses into `new`'s value and is left out of --help (kept for one release)."""
    p.add_argument(old, dest=new.lstrip("-").replace("-", "_"), default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS, **kw)
