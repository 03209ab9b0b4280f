"""The docs stay true to the code: every `kvlab` command a learner copies from README.md, docs/*.md
or a notebook names a sub-command and flags its `--help` lists, every `make` target exists, and
every relative link points at a file in this repository (nothing outside it, like DESIGN.md)."""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOK_SOURCES = sorted((ROOT / "labs").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "labs").glob("*.ipynb"))

FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"`([^`]+)`")  # a code span may wrap onto the next line
# `kvlab …`, `.venv/bin/kvlab …`, `!kvlab …`, `python -m kvlab.cli …`
INVOCATION = re.compile(r"(?:^|(?<=[\s(!\"'=:;|&]))(?:[\w./-]*bin/)?(?:kvlab|python3? -m kvlab\.cli)[ \t]+(.*)$")
# `kvlab` as a name, not the command: `-n kvlab`, `--name kvlab`, `namespace kvlab`, `in kvlab rolled out`
NOT_COMMAND = re.compile(r"(?:-n|--name|--namespace|namespace|in|kind-kvlab/)\s*$")
MAKE = re.compile(r"(?:^|(?<=[\s(;&]))make[ \t]+([a-z][\w-]*)((?:[ \t]+\w+=(?:\"[^\"]*\"|'[^']*'|\S+))*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\b(?:DESIGN|ENVIRONMENT)\.md\b")


def _fenced_and_inline(text: str) -> list[str]:
    """Command-like snippets: each logical line of a fenced block, and each inline code span."""
    snippets = []
    for block in FENCE.findall(text):
        snippets += block.replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    for paragraph in re.split(r"\n\s*\n", prose):  # a stray backtick spoils one paragraph at most
        snippets += [span.replace("\n", " ") for span in INLINE.findall(paragraph)]
    return snippets


def _notebook_snippets(path: Path) -> list[str]:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        markdown = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    else:  # jupytext percent format: markdown cells are `# ` comment lines
        lines = path.read_text().splitlines()
        markdown = "\n".join(line[2:] for line in lines if line.startswith("# "))
        code = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    # Python, not shell: `import kvlab` and messages that name the package are not commands
    code_lines = [line for line in code.replace("\\\n", " ").splitlines()
                  if not re.match(r"\s*(?:import|from)\s", line)]
    return _fenced_and_inline(markdown) + [CODE_MARK + line for line in code_lines]


CODE_MARK = "\0"  # marks a notebook code line: unknown words after `kvlab` there are prose in strings


def _sources() -> dict[Path, list[str]]:
    found = {path: _fenced_and_inline(path.read_text()) for path in MARKDOWN}
    found.update({path: _notebook_snippets(path) for path in NOTEBOOK_SOURCES + NOTEBOOKS})
    return found


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line)


def _words(rest: str) -> list[str]:
    """The words of one command, up to where a shell would end it."""
    rest = re.split(r"\s(?:&&|\|\||\||;|>|2>|<\s)\s?|\)", rest)[0]
    try:
        return shlex.split(rest)
    except ValueError:  # an unbalanced quote in prose: plain split is good enough for flags
        return rest.split()


def _placeholder(word: str) -> bool:
    return bool(re.match(r"^[<\[{…]|^\.\.\.|^\$", word)) or word in {"…", "..."}


def invocations() -> list[tuple[str, list[str]]]:
    """(where, words after `kvlab`) for every command the docs and notebooks show."""
    found = []
    for path, snippets in _sources().items():
        where = str(path.relative_to(ROOT))
        for snippet in snippets:
            line = _strip_comment(snippet) if not snippet.lstrip().startswith(("print(", "f\"")) else snippet
            for make in MAKE.finditer(line):
                args = re.search(r"LAB_ARGS=(\"[^\"]*\"|'[^']*'|\S+)", make.group(2) or "")
                if make.group(1) == "lab" and args:
                    found.append((where, ["lab", *shlex.split(args.group(1).strip("\"'"))]))
            in_code = line.startswith(CODE_MARK)
            for part in re.split(r"&&|;|\|\|", line.lstrip(CODE_MARK)):
                match = INVOCATION.search(part)
                if not match or NOT_COMMAND.search(part[:match.start()]):
                    continue
                words = _words(match.group(1))
                if words:
                    words[0] = words[0].rstrip(":,.")
                if not words or _placeholder(words[0]) or (in_code and words[0] not in COMMANDS):
                    continue
                found.append((where, words))
    return found


@functools.cache
def _help(*command: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "kvlab.cli", *command, "--help"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    return done.returncode, done.stdout + done.stderr


def _nested(sub: str) -> set[str]:
    """Sub-sub-commands a command's help offers: argparse `{a,b}` choices or a `backends:` list."""
    _, text = _help(sub)
    names = set()
    for group in re.findall(r"^  \{([\w,-]+)\}", text, re.MULTILINE):  # under "positional arguments:"
        names |= set(group.split(","))
    if "<backend>" in text.split("\n\n")[0]:
        names |= set(re.findall(r"^  (\w[\w-]*)\s{2,}", text, re.MULTILINE))
    return names


def problems_in(command: list[str]) -> list[str]:
    sub, rest = command[0], command[1:]
    if sub.startswith("-"):
        return [] if sub in {"--help", "-h", "--version"} else [f"`kvlab {sub}`: not an option of `kvlab`"]
    if sub not in COMMANDS:
        return [f"`kvlab {sub}`: no such command (kvlab.cli.COMMANDS)"]
    helps = [_help(sub)[1]]
    nested = _nested(sub)
    positional = next((w for w in rest if not w.startswith("-")), None)
    if nested and positional and not _placeholder(positional):
        alternatives = re.split(r"[|/]", positional)  # `traces list|show|explain` names several
        unknown = [name for name in alternatives if name not in nested]
        if unknown:
            return [f"`kvlab {sub} {positional}`: {unknown} not in {sorted(nested)}"]
        for name in alternatives:
            code, text = _help(sub, name)
            assert code == 0, text
            helps.append(text)
    problems = []
    for word in rest:
        if not word.startswith("-") or word in {"-", "--", "-h", "--help"} or _placeholder(word[2:]):
            continue
        flag = word.split("=", 1)[0]
        if re.fullmatch(r"-\d.*", flag):  # a negative number as a value
            continue
        if not any(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) for text in helps):
            problems.append(f"`kvlab {' '.join(command)}`: `{flag}` is not in `kvlab {sub} --help`")
    return problems


@pytest.mark.processes
def test_every_documented_command_uses_options_its_help_lists() -> None:
    found = invocations()
    # the scan itself works: the docs' best-known commands are found
    subs = {words[0] for _, words in found}
    assert {"lab", "up", "bench", "traces", "cluster", "engine"} <= subs, subs
    assert any(w[:2] == ["lab", "--quick"] for _, w in found), "make lab LAB_ARGS=\"--quick\" not parsed"
    problems = sorted({f"{where}: {p}" for where, words in found for p in problems_in(words)})
    assert not problems, "\n".join(problems)


@pytest.mark.processes
def test_the_check_catches_a_flag_help_does_not_list() -> None:
    assert problems_in(["lab", "--quick", "--users", "4"]) == []
    assert problems_in(["traces", "explain", "<id>", "--run-dir", "runs/latest"]) == []
    assert problems_in(["lab", "--quikc"]), "a misspelt flag must be reported"
    assert problems_in(["traces", "explian"]), "a misspelt sub-command must be reported"
    assert problems_in(["labs"]), "an unknown command must be reported"


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+)\s*:(?!=)", text, re.MULTILINE))


def test_every_documented_make_target_exists() -> None:
    targets = _make_targets()
    missing = sorted({f"{path.relative_to(ROOT)}: `make {m.group(1)}`"
                      for path, snippets in _sources().items() for s in snippets
                      for m in MAKE.finditer(_strip_comment(s)) if m.group(1) not in targets})
    assert {"lab", "test", "vllm"} <= targets
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_into_the_repository(path: Path) -> None:
    text = path.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z+.-]*:|^#", target):  # http:, mailto:, an anchor on the page
            continue
        resolved = (path.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to missing files {broken}"
    assert not OUTSIDE.search(text), f"{path.relative_to(ROOT)} names a file learners do not have"


ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w/])#\d{1,3}\b(?!\s*[0-9a-f])", re.IGNORECASE)
# a developer's machine in a transcript: home directories, this project's checkouts
MACHINE_PATH = re.compile(r"(?<![\w.~$])/(?:home/[\w.-]+|Users/[\w.-]+|work/[\w.-]+|root)/")


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_sections_not_issue_numbers_and_show_no_machine_paths(path: Path) -> None:
    """A reader has no issue tracker to look up and no developer's home directory: docs point at
    sections and commands, and transcripts show paths relative to the checkout."""
    text = path.read_text()
    issues = sorted({m.group(0) for m in ISSUE.finditer(FENCE.sub("", text))})
    assert not issues, f"{path.relative_to(ROOT)} refers to issue numbers {issues}: name the section or command"
    paths = sorted({line.strip() for block in FENCE.findall(text) for line in block.splitlines()
                    if MACHINE_PATH.search(line)})
    assert not paths, f"{path.relative_to(ROOT)}: transcripts show a machine's absolute paths: {paths}"


def test_the_doc_checks_catch_an_issue_number_and_a_machine_path() -> None:
    assert ISSUE.search("as measured for issue 13") and ISSUE.search("(Issue #21)")
    assert not ISSUE.search("a 4-replica lab, 13 issues left") and not ISSUE.search("color: #fff")
    assert MACHINE_PATH.search("report:  /work/main/runs/x/report.html")
    assert MACHINE_PATH.search("/home/alice/kvlab/runs") and not MACHINE_PATH.search("runs/x/report.html")
    assert not MACHINE_PATH.search("/var/run/nvidia-container-devices") and not MACHINE_PATH.search("~/work/x/")


# who ran a figure, beside what, how often: a development log's asides, kept to its appendices
HISTORY = re.compile(r"another helper|fresh-clone CI|official CI|beside (?:another|lab \d+'s) notebook|"
                     r"runs of stop \d+|\bin \d+ of \d+ seeded runs", re.IGNORECASE)
HISTORY_PAGES = {"development.md", "benchmarks-history.md", "twin-validation.md"}
USER_PAGES = [p for p in MARKDOWN if p.name not in HISTORY_PAGES] + sorted((ROOT / "labs").glob("[0-9][0-9]-*.py"))


@pytest.mark.parametrize("path", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_and_labs_tell_no_development_history(path: Path) -> None:
    """Pages a user reads say what a figure is and which command made it, not who ran it beside what:
    that record lives in development.md, benchmarks-history.md and twin-validation.md."""
    found = sorted({m.group(0) for m in HISTORY.finditer(path.read_text())})
    assert not found, f"{path.relative_to(ROOT)} reads like a development log: {found}"


def test_the_history_check_catches_an_aside() -> None:
    assert HISTORY.search("a third run beside lab 10's notebook test") and HISTORY.search("runs of stop 26")
    assert HISTORY.search("in 3 of 4 seeded runs") and HISTORY.search("as a fresh-clone CI run showed")
    assert not HISTORY.search("more than any other non-notebook test of the suite")


@functools.cache
def _rendered_kind() -> tuple[str, set[str]]:
    """What `kvlab cluster render` writes for the main GPU topology and the CPU quickstart: the vLLM
    pods' KV-event topic (with `<model>` for the model) and every flag in any manifest."""
    from kvlab.stack.kind import manifests as m
    from kvlab.stack.kind import objects as o
    from kvlab.stack.kind.plan import gateway_api_phases
    from kvlab.topology import builtin, load_topology

    flags: set[str] = set()
    topic = ""
    for name, on_gpu in (("gpu-1", True), ("quickstart", False), ("pd", True), ("wide-ep", True)):
        topology, cluster = load_topology(builtin(name)), o.Cluster(gpu=on_gpu)
        phases = {**m.render(topology, cluster), **gateway_api_phases(topology, cluster)}
        text = json.dumps(phases)
        flags |= set(re.findall(r"--[a-z][\w-]+", text))
        if name == "gpu-1":
            vllm = next(c for x in phases["baseline"] if x["kind"] == "Deployment"
                        for c in x["spec"]["template"]["spec"]["containers"])
            config = json.loads(vllm["args"][vllm["args"].index("--kv-events-config") + 1])
            topic = config["topic"].replace(f"@{topology.model}", "@<model>")
            assert config["endpoint"] == f"tcp://*:{o.KV_EVENTS_PORT}"
    return topic, flags


KIND_DOC = ROOT / "docs" / "kind.md"
HOST_TOOL_FLAGS = {"--as", "--cdi", "--from-file", "--in-place", "--rm", "--runtime", "--set",
                   "--set-as-default", "--wait"}   # kubectl, docker, nvidia-ctk in docs/kind.md


@pytest.mark.processes
def test_kind_doc_quotes_the_rendered_topic_ports_and_flags() -> None:
    """docs/kind.md describes the pods `kvlab cluster render` writes: the KV-event topic, the
    ports and NodePorts, and every flag it quotes is in a manifest, a kvlab `--help` or a host tool."""
    from kvlab.engine.vllm import KV_TOPIC
    from kvlab.stack.kind import objects as o

    topic, rendered_flags = _rendered_kind()
    text = KIND_DOC.read_text()
    quoted = re.findall(r"topic `([^`]+)`", text)
    assert quoted and all(t == topic for t in quoted), f"docs/kind.md says topic {quoted}, pods publish {topic!r}"
    assert set(re.findall(r"tcp://\*:(\d+)", text)) == {str(o.KV_EVENTS_PORT)}
    node_ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(3[0-2]\d{3})\b", text)}
    assert node_ports and node_ports <= set(o.NODE_PORTS.values()), node_ports - set(o.NODE_PORTS.values())
    helps = "".join(_help(*c)[1] for c in (("cluster",), ("lab",), ("bench",), ("compare",)))
    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]+", text))
    unknown = sorted(f for f in flags - HOST_TOOL_FLAGS if f not in rendered_flags
                     and not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", helps))
    assert not unknown, f"docs/kind.md quotes flags no manifest or help has: {unknown}"
    for path in MARKDOWN:   # elsewhere a topic is the local stack's or the pods'
        for t in re.findall(r"topic `([^`]+)`", path.read_text()):
            assert t in {KV_TOPIC, topic}, f"{path.relative_to(ROOT)}: topic `{t}` is published by nothing"


def test_benchmarks_open_with_a_summary_each_figure_with_machine_date_and_command() -> None:
    """docs/benchmarks.md is for a reader: its first section is one table, every figure in it
    saying the machine, the date and the command that made it (the run logs are in the history)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    first = text.split("\n## ", 2)[1]
    assert first.startswith("Summary\n"), "the first section of docs/benchmarks.md must be the summary"
    rows = [line for line in first.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert {"figure", "machine (load)", "date", "command"} <= set(header), header
    for row in rows[2:]:
        cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True))
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells["date"]), row
        assert cells["machine (load)"] and re.search(r"`[^`]+`", cells["command"]), row
    assert len(rows) >= 8
