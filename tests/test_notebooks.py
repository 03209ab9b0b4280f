"""The lab notebooks (labs/NN-*.ipynb): paired with their py:percent files, executed top to bottom on
the local simulator target (any cell error or failed checkpoint fails), rendered to HTML and
loaded in headless Chromium, where every plotly figure must draw without a JavaScript error.

This module checks every notebook's pairing and sections and that the shards together run every lab
in the learners' order, runs the quickstart shard and one notebook alone; the other shards are
test_notebooks_{topologies_a,topologies_b,experiments,topologies_c}.py (tests/notebook_runs.py says why). Every stack a notebook starts lives under a temporary
KVLAB_RUNS_DIR and is stopped by pid (supervisor, its children, processes the notebooks recorded)
when the module ends, pass or fail.
"""

from __future__ import annotations

import pytest

from kvlab.stack.base import read_info
from notebook_runs import (
    LABS,
    NOTEBOOKS,
    SHARDS,
    _execute,
    _runs_env,
    jupytext,
    labs_map,
    nbformat,
    render_shard,
    run_notebook,
    shard,
)


def test_every_notebook_has_its_py_percent_pair_in_sync():
    pys = sorted(p for p in LABS.glob("[0-9][0-9]-*.py"))
    assert [p.stem for p in pys] == [p.stem for p in NOTEBOOKS] and len(NOTEBOOKS) >= 7
    for ipynb in NOTEBOOKS:
        nb = nbformat.read(ipynb, as_version=4)
        py = jupytext.read(ipynb.with_suffix(".py"), fmt="py:percent")
        assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent", ipynb.name
        assert nb.metadata["kernelspec"]["name"] == "python3", ipynb.name
        pairs = list(zip([(c.cell_type, c.source) for c in nb.cells], [(c.cell_type, c.source) for c in py.cells]))
        assert len(nb.cells) == len(py.cells), f"{ipynb.name}: {len(nb.cells)} cells vs {len(py.cells)} in the .py"
        for i, (a, b) in enumerate(pairs):
            assert a == b, f"{ipynb.name} cell {i} differs from the .py: run `jupytext --sync labs/{ipynb.name}`"
        # committed without outputs (docs/labs.md): small diffs, no stale numbers
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code"), \
            f"{ipynb.name} has outputs: `jupytext --sync` then clear outputs before committing"


def test_every_notebook_has_objectives_parameters_checkpoints_and_troubleshooting():
    for ipynb in NOTEBOOKS:
        nb = nbformat.read(ipynb, as_version=4)
        text = "\n".join(c.source for c in nb.cells)
        assert "**Objectives**" in nb.cells[0].source, ipynb.name
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1 and 'TARGET = "local"' in params[0].source, ipynb.name
        assert "## Checkpoints" in text and "## Troubleshooting" in text, ipynb.name
        checkpoint = nb.cells[next(i for i, c in enumerate(nb.cells) if "## Checkpoints" in c.source) + 1]
        assert checkpoint.cell_type == "code" and "assert " in checkpoint.source, ipynb.name


def test_the_shards_run_every_lab_once_in_the_learners_order():
    """One learner session, cut where nothing carries over: the shards, one after another, are every
    lab in order; a lab that reuses what the lab before left (its **Stack:** line says `reuses`)
    never opens a shard, and a shard opens on a lab that starts its own stack."""
    assert [p for s in SHARDS.values() for p in s] == NOTEBOOKS
    firsts = {s[0].stem for s in SHARDS.values()}
    for ipynb in NOTEBOOKS:
        stack = labs_map.read_lab(ipynb.with_suffix(".py")).stack
        if ipynb.stem in firsts and ipynb != NOTEBOOKS[0]:
            assert stack.startswith("starts"), f"{ipynb.stem} opens a shard but does not start its own stack: {stack}"
        if stack.startswith("reuses"):
            assert ipynb.stem not in firsts, ipynb.stem


@pytest.mark.slow
@pytest.mark.parametrize("ipynb", shard("quickstart"))
def test_notebook_runs_top_to_bottom_on_the_local_simulator(ipynb, runs_dir):
    run_notebook(ipynb, runs_dir)


@pytest.mark.slow
def test_a_notebook_runs_alone_starting_what_it_needs():
    """Lab 04 in an empty runs dir: it starts the stack and runs both phases itself (shorter here)."""
    with _runs_env("kvlab-nb-alone-") as runs:
        _execute(LABS / "04-traces.ipynb", runs.parent / "04-traces.ipynb", overrides="DURATION_S = 10.0")
        run = (runs / "latest").resolve()
        assert (run / "phase-1-round-robin" / "summary.json").exists()
        assert (run / "phase-2-kv-aware" / "summary.json").exists()
        stack = read_info(run)
        assert stack is not None and stack.status == "running"     # left running for the next lab, until teardown


@pytest.mark.slow
def test_executed_notebooks_render_their_plots_in_chromium(runs_dir, tmp_path):
    render_shard("quickstart", tmp_path)
