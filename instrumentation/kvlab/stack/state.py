"""Run directories on disk (runs/<id>/, runs/latest); stack.json itself is kvlab.stack.base."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kvlab.lifecycle import write_atomic


def runs_dir() -> Path:
    """Where run directories go: $KVLAB_RUNS_DIR, else ./runs."""
    return Path(os.environ.get("KVLAB_RUNS_DIR", "runs")).absolute()


def new_run_dir(label: str, root: Path | None = None) -> Path:
    """A fresh runs/<YYYYmmdd-HHMMSS>-<label>[-n] directory."""
    root = root or runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    for n in range(1000):
        path = root / (base if n == 0 else f"{base}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a run dir under {root}")


def set_latest(run_dir: Path) -> None:
    """Point <runs>/latest at `run_dir` (relative symlink, replaced atomically)."""
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (readers never see half a file)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n")

