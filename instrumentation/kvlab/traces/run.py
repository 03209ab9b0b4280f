"""Where a run keeps its traces and client-side request records (runs/<id>/, see docs/lab.md)."""

from __future__ import annotations

from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.load.measure import Record, read_records
from kvlab.stack.base import read_info

DEFAULT_RUNS = Path("runs")


def resolve_run(run_dir: Path | None) -> Path:
    """`run_dir`, or runs/latest when None; KvlabError when it does not exist."""
    path = Path(run_dir) if run_dir is not None else DEFAULT_RUNS / "latest"
    if not path.exists():
        raise KvlabError(f"no run at {path} (give --run DIR or --jaeger URL)")
    return path.resolve()


def traces_location(run_dir: Path | None) -> tuple[str, Path | str]:
    """("files", dir) or ("jaeger", query URL) for a run.

    stack.json's `traces_dir` (absolute, or relative to the working directory or to the folder
    holding runs/) wins; a `jaeger` query URL there means spans went to a Jaeger the stack
    started; else `<run>/traces/`, else the run dir itself when it holds *.jsonl span files.
    """
    run = resolve_run(run_dir)
    info = read_info(run)
    if info is not None and info.traces_dir:
        rel = Path(info.traces_dir)
        for candidate in (rel, Path.cwd() / rel, run.parent.parent / rel, run / rel.name):
            if candidate.is_dir():
                return "files", candidate
    if info is not None and info.jaeger:
        return "jaeger", info.jaeger
    if (run / "traces").is_dir():
        return "files", run / "traces"
    if any(run.glob("*.jsonl")):
        return "files", run
    raise KvlabError(f"{run}: no traces (no stack.json traces_dir, no traces/ folder); "
                     "for a Jaeger-backed run use --jaeger URL")


def load_requests(run_dir: Path | None) -> list[Record]:
    """Every client-side request record (requests.jsonl of each phase) under the run; [] when the
    run has none (e.g. a plain `kvlab up`)."""
    try:
        run = resolve_run(run_dir)
    except KvlabError:
        return []
    return [r for path in sorted(run.rglob("requests.jsonl")) for r in read_records(path)]
