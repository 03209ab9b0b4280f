"""The notebooks of the `topologies-c` shard (tests/notebook_runs.py), in their own runs dir and module,
so that `make test` runs them beside the other shards: executed top to bottom, then drawn in Chromium."""

from __future__ import annotations

import pytest

from notebook_runs import render_shard, run_notebook, shard


@pytest.mark.slow
@pytest.mark.parametrize("ipynb", shard("topologies-c"))
def test_notebook_runs_top_to_bottom_on_the_local_simulator(ipynb, runs_dir):
    run_notebook(ipynb, runs_dir)


@pytest.mark.slow
def test_executed_notebooks_render_their_plots_in_chromium(runs_dir, tmp_path):
    render_shard("topologies-c", tmp_path)
