"""The machinery of the notebook tests (test_notebooks*.py): the shards, a fresh runs dir per
module whose processes are stopped by pid, the kernel, execution and rendering in Chromium.

The notebooks run in the order a learner runs them, cut into shards, one test module each, every
module with its own runs dir: under `make test` (pytest-xdist, --dist loadfile) the shards run on
separate workers at once. Each shard is a run of consecutive labs, and each cut falls before a lab
that starts its own stack (its **Stack:** line says so; test_notebooks.py checks both): the
quickstart shard is 00-04 (03 and 04 reuse the stack and the phases of 01-02), then 05-07, 08-09,
10 (the longest, ~6 minutes) and 11 onward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import require, require_binary, stop_everything

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
NOTEBOOKS = sorted(LABS.glob("[0-9][0-9]-*.ipynb"))
# each shard's first lab, in the learners' order; a shard runs up to the next one's first
_FIRST = {"quickstart": 0, "topologies-a": 5, "topologies-b": 8, "experiments": 10, "topologies-c": 11}
SHARDS = {name: [p for p in NOTEBOOKS if first <= int(p.stem[:2]) < nxt]
          for (name, first), nxt in zip(_FIRST.items(), [*list(_FIRST.values())[1:], 100])}

def _labs_map():
    """scripts/labs_map.py: each lab's title, **Time:**, **Stack:** and checkpoint bullets."""
    spec = importlib.util.spec_from_file_location("labs_map", ROOT / "scripts" / "labs_map.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["labs_map"] = module        # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


labs_map = _labs_map()
PLOTLY_MIME = "application/vnd.plotly.v1+json"
EXECUTED: dict[str, Path] = {}      # notebook name -> executed copy (filled by run_notebook)

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")


def shard(name: str) -> list:
    """The shard's notebooks as test parameters, named by their stems."""
    return [pytest.param(nb, id=nb.stem) for nb in SHARDS[name]]


# ---- execution --------------------------------------------------------------------------------------
@contextmanager
def _runs_env(prefix: str):
    """A fresh runs dir for the kernels (they inherit KVLAB_RUNS_DIR: stacks land there); on exit
    the variable is restored and every process recorded under it is stopped, or the test fails."""
    runs = Path(tempfile.mkdtemp(prefix=prefix)) / "runs"
    old = os.environ.get("KVLAB_RUNS_DIR")
    os.environ["KVLAB_RUNS_DIR"] = str(runs)
    try:
        yield runs
    finally:
        if old is None:
            os.environ.pop("KVLAB_RUNS_DIR", None)
        else:
            os.environ["KVLAB_RUNS_DIR"] = old
        left = stop_everything(runs)
        assert not left, f"processes still running after teardown: {left}"


def _execute(ipynb: Path, out: Path, overrides: str = "") -> None:
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(ipynb, as_version=4)
    if overrides:      # papermill-style: a cell right after the parameters cell
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(overrides))
    client = NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(LABS)}})
    try:
        client.execute()
    except CellExecutionError as exc:
        raise AssertionError(f"{ipynb.name} failed:\n{str(exc)[-4000:]}") from None
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)


def _kernel_python() -> None:
    """The kernel nbclient starts is this interpreter (.venv): the native python3 kernelspec."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    exe = spec.argv[0]
    assert exe in (sys.executable, "python", "python3") or Path(exe).resolve() == Path(sys.executable).resolve(), \
        f"the python3 kernel runs {exe}, not {sys.executable}"


def run_notebook(ipynb: Path, runs_dir: Path) -> None:
    """Execute `ipynb` in the module's runs dir; no error output, and its checkpoint cell printed ✓."""
    _kernel_python()
    out = runs_dir.parent / "executed" / ipynb.name
    _execute(ipynb, out)
    EXECUTED[ipynb.stem] = out
    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    last = [c for c in nb.cells if c.cell_type == "code" and "assert " in c.source][-1]
    assert any("✓" in o.get("text", "") for o in last.outputs), f"{ipynb.name}: the checkpoint cell printed no ✓"


# ---- rendering ------------------------------------------------------------------------------------
CATCH_ERRORS = """<script>window.__kvlabErrors = [];
window.addEventListener('error', function (e) { window.__kvlabErrors.push(String(e.message)); });
window.addEventListener('load', function () { setTimeout(function () {
  var pre = document.createElement('pre'); pre.id = 'kvlab-js-errors';
  pre.textContent = JSON.stringify(window.__kvlabErrors); document.body.appendChild(pre);
  var n = document.createElement('pre'); n.id = 'kvlab-plots';
  n.textContent = String(document.querySelectorAll('.js-plotly-plot .main-svg').length > 0 ?
     document.querySelectorAll('.js-plotly-plot').length : 0);
  document.body.appendChild(n); }, 3000); });
</script>"""


def _render_html(executed: Path, out: Path) -> Path:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nbformat.read(executed, as_version=4))
    out.write_text(body.replace("<head>", "<head>" + CATCH_ERRORS, 1), encoding="utf-8")
    return out


def _dump_dom(chromium: str, html: Path) -> str:
    with tempfile.TemporaryDirectory(prefix="kvlab-chromium-") as profile:
        argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                "--virtual-time-budget=15000", "--dump-dom", html.as_uri()]
        return subprocess.run(argv, capture_output=True, text=True, timeout=180).stdout


def render_shard(name: str, tmp_path: Path) -> None:
    """The shard's executed notebooks drawn in Chromium: no JavaScript error, every plot drawn; the
    quickstart shard also checks a screenshot of lab 02."""
    chromium = require_binary("chromium")
    executed_here = {p.stem: EXECUTED[p.stem] for p in SHARDS[name] if p.stem in EXECUTED}
    require(bool(executed_here), "executed notebooks (run the whole module)")   # a failed one already failed its test
    from PIL import Image

    from kvlab.traces.screenshot import screenshot

    for notebook, executed in sorted(executed_here.items()):
        nb = nbformat.read(executed, as_version=4)
        expected = sum(1 for c in nb.cells for o in c.get("outputs", []) if PLOTLY_MIME in o.get("data", {}))
        assert expected >= 1, f"{notebook}: no plotly figure"
        html = _render_html(executed, tmp_path / f"{notebook}.html")
        dom = _dump_dom(chromium, html)
        errors = re.search(r'<pre id="kvlab-js-errors">(.*?)</pre>', dom, re.S)
        plots = re.search(r'<pre id="kvlab-plots">(\d+)</pre>', dom)
        assert errors and plots, f"{notebook}: the page did not finish loading in Chromium"
        assert json.loads(errors.group(1).replace("&quot;", '"')) == [], f"{notebook}: JavaScript errors {errors.group(1)}"
        assert int(plots.group(1)) == expected, f"{notebook}: {plots.group(1)} plots drawn, {expected} expected"
    if name != "quickstart":
        return
    require("02-kv-aware" in EXECUTED, "lab 02 executed")
    png = screenshot(tmp_path / "02-kv-aware.html", tmp_path / "02-kv-aware.png", width=1300, height=2600,
                     budget_ms=10000)
    image = Image.open(png).convert("RGB").resize((260, 520))
    pixels = list(image.getdata())
    coloured = sum(1 for r, g, b in pixels if max(r, g, b) - min(r, g, b) > 40)   # plot lines and bars
    assert coloured > 0.01 * len(pixels), "the screenshot shows no coloured plot marks"
    keep = os.environ.get("KVLAB_NOTEBOOK_SCREENSHOT")
    if keep:
        Path(keep).write_bytes(png.read_bytes())
