"""The map of the labs (docs/labs.md's table, README.md's list) is what the notebooks say of
themselves: title, **Time:**, **Stack:** and the bullets above their checkpoint cells
(scripts/labs_map.py). A stack line's replica count is its topology file's, and a checkpoint cell
asserts at least one thing per bullet."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from kvlab.topology import builtin, load_topology

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("labs_map", ROOT / "scripts" / "labs_map.py")
labs_map = importlib.util.module_from_spec(_spec)
sys.modules["labs_map"] = labs_map
_spec.loader.exec_module(labs_map)


def test_docs_labs_table_and_readme_list_agree_with_the_notebooks():
    for path, text in labs_map.expected().items():
        assert path.read_text(encoding="utf-8") == text, \
            f"{path.name} disagrees with the notebooks: run `python scripts/labs_map.py --write`"


def test_every_lab_is_on_the_map():
    labs = labs_map.labs()
    stems = [p.stem for p in sorted((ROOT / "labs").glob("[0-9][0-9]-*.ipynb"))]
    assert [lab.stem for lab in labs] == stems
    table = labs_map.table(labs)
    assert all(f"`{s}`" in table for s in stems)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert all(f"labs/{s}.ipynb" in readme for s in stems)


def test_a_stack_line_counts_its_topologys_replicas():
    checked = 0
    for lab in labs_map.labs():
        m = re.search(r"`([\w-]+)`(?: stack)? \((\d+) replicas?\b", lab.stack)
        if not m:
            continue
        assert m.group(1) == lab.topology, f"{lab.stem}: the stack line names {m.group(1)}, TOPOLOGY is {lab.topology}"
        replicas = load_topology(builtin(m.group(1))).total_replicas
        assert int(m.group(2)) == replicas, f"{lab.stem}: {m.group(2)} replicas in its stack line, {replicas} in the topology"
        checked += 1
    assert checked >= 8


def test_each_checkpoint_bullet_has_an_assert_behind_it():
    for lab in labs_map.labs():
        text = (ROOT / "labs" / f"{lab.stem}.py").read_text(encoding="utf-8")
        cell = text.split("# ## Checkpoints", 1)[1].split("# %%\n", 1)[1].split("# %%", 1)[0]
        asserts = len(re.findall(r"^\s*assert ", cell, re.M))
        assert lab.checkpoints, f"{lab.stem}: no bullets under ## Checkpoints"
        assert asserts >= len(lab.checkpoints), f"{lab.stem}: {len(lab.checkpoints)} bullets, {asserts} asserts"
