"""The map of the labs, read from the notebooks themselves: each lab's title, its **Time:** and
**Stack:** lines (first cell) and the bullets under its `## Checkpoints` heading become the table in
docs/labs.md and the list in README.md, between `<!-- labs:begin -->` and `<!-- labs:end -->`.

    python scripts/labs_map.py          # exit 1 and say which file differs
    python scripts/labs_map.py --write  # rewrite both files

tests/test_labs_map.py runs the check, so the map cannot drift from the notebooks.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
BEGIN, END = "<!-- labs:begin -->", "<!-- labs:end -->"


@dataclass(frozen=True)
class Lab:
    stem: str           # 02-kv-aware
    title: str          # the first heading after "Lab NN ·"
    time: str
    stack: str
    checkpoints: list[str]
    topology: str | None   # the parameters cell's TOPOLOGY, if any


def _markdown_cells(py: Path) -> list[str]:
    """The markdown cells of a py:percent notebook, comment marks stripped."""
    cells, current = [], None
    for line in py.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            if current is not None:
                cells.append("\n".join(current).strip())
            current = [] if "[markdown]" in line else None
        elif current is not None:
            current.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
    if current is not None:
        cells.append("\n".join(current).strip())
    return cells


def _field(text: str, name: str, where: str) -> str:
    """The paragraph-line value of `**Name:** …`, continuation lines joined, up to the next field."""
    m = re.search(rf"^\*\*{name}:\*\* (.+?)(?=\n\*\*\w+:\*\*|\n\n|\Z)", text, re.S | re.M)
    if not m:
        raise ValueError(f"{where}: no **{name}:** line in the first cell")
    return " ".join(m.group(1).split()).rstrip(".")


def _bullets(text: str) -> list[str]:
    """Top-level `- ` items, their indented continuation lines joined."""
    items: list[str] = []
    for line in text.splitlines():
        if line.startswith("- "):
            items.append(line[2:].strip())
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
        elif items and not line.strip():
            break
    return items


def read_lab(py: Path) -> Lab:
    cells = _markdown_cells(py)
    first = cells[0]
    title = re.match(r"# Lab \d+ · (.+)", first)
    if not title:
        raise ValueError(f"{py.name}: the first cell should start `# Lab NN · title`")
    checkpoints = next((c for c in cells if c.startswith("## Checkpoints")), None)
    if checkpoints is None:
        raise ValueError(f"{py.name}: no `## Checkpoints` cell")
    topology = re.search(r'^TOPOLOGY = "([\w-]+)"', py.read_text(encoding="utf-8"), re.M)
    return Lab(stem=py.stem, title=title.group(1).strip(), time=_field(first, "Time", py.name),
               stack=_field(first, "Stack", py.name), checkpoints=_bullets(checkpoints),
               topology=topology.group(1) if topology else None)


def labs() -> list[Lab]:
    return [read_lab(p) for p in sorted(LABS.glob("[0-9][0-9]-*.py"))]


def table(all_labs: list[Lab]) -> str:
    rows = ["| notebook | what you do | stack | what the checkpoints assert | time |", "|---|---|---|---|---|"]
    rows += [f"| [`{lab.stem}`](../labs/{lab.stem}.ipynb) | {lab.title} | {lab.stack} | "
             f"{' · '.join(lab.checkpoints)} | {lab.time} |" for lab in all_labs]
    return "\n".join(rows)


def readme_list(all_labs: list[Lab]) -> str:
    return "\n".join(f"- [`{lab.stem}`](labs/{lab.stem}.ipynb): {lab.title}" for lab in all_labs)


def _splice(text: str, body: str, where: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{where}: needs one {BEGIN} and one {END}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def expected() -> dict[Path, str]:
    """Each file the map lives in, as it should read."""
    found = labs()
    docs, readme = ROOT / "docs" / "labs.md", ROOT / "README.md"
    return {docs: _splice(docs.read_text(encoding="utf-8"), table(found), "docs/labs.md"),
            readme: _splice(readme.read_text(encoding="utf-8"), readme_list(found), "README.md")}


def main(argv: list[str]) -> int:
    stale = [path for path, text in expected().items() if path.read_text(encoding="utf-8") != text]
    if "--write" in argv:
        for path, text in expected().items():
            path.write_text(text, encoding="utf-8")
        return 0
    for path in stale:
        print(f"{path.relative_to(ROOT)} disagrees with the notebooks: run `python scripts/labs_map.py --write`")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
