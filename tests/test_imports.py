"""The package's imports run one way: down a stated order of layers, with no import circle.

`LAYERS` is the order, lowest first (docs/architecture.md, "Layers", states the same list): a module
may import its own layer and those below it, never one above, at module level. A module belongs to
the layer of the longest prefix that names it. Circles are looked for among every import, the lazy
ones inside functions included; only `if TYPE_CHECKING:` blocks (types only, never run) do not count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "instrumentation" / "kvlab"

LAYERS = [
    # foundations: errors, names, OTel, the wire formats, tokenizers, the machine's facts
    ["kvlab", "kvlab.errors", "kvlab.contract", "kvlab.lifecycle", "kvlab.process", "kvlab.config", "kvlab.httpedge",
     "kvlab.tokenizer", "kvlab.conversation", "kvlab.doctor", "kvlab.kvcache", "kvlab.telemetry", "kvlab.dashboards"],
    # the serving parts: engines, the gateway, the endpoint picker
    ["kvlab.engine", "kvlab.gateway", "kvlab.epp"],
    # what a lab is and what a run measures: the topology, load, the results compare rows and sweeps hold
    ["kvlab.topology", "kvlab.load", "kvlab.compare.results", "kvlab.compare.sweep"],
    ["kvlab.stack"],                                   # processes and clusters
    ["kvlab.run"],                                     # phases, routers, the run document, presets
    ["kvlab.traces", "kvlab.report"],                  # reading a run
    ["kvlab.lab", "kvlab.scenarios", "kvlab.calibration", "kvlab.twin"],   # drivers
    ["kvlab.compare", "kvlab.plan"],                   # drivers over drivers: compare (the lab's spec), plan (the twin)
    ["kvlab.cli", "kvlab.notebook", "kvlab.load.cli", "kvlab.load.locustfile"],   # entry points (locust runs the locustfile)
]


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nodes(node: ast.AST, lazy: bool) -> Iterator[ast.AST]:
    """The nodes that run: `if TYPE_CHECKING:` bodies skipped; function and class bodies only if `lazy`."""
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        for child in node.orelse:
            yield from _nodes(child, lazy)
        return
    if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _nodes(child, lazy)


def _graph(lazy: bool = False) -> dict[str, set[str]]:
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for top in ast.parse(path.read_text()).body:
            for n in _nodes(top, lazy):
                if isinstance(n, ast.Import):
                    graph[name] |= {a.name for a in n.names if a.name in modules}
                elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and n.module.startswith("kvlab"):
                    subs = {f"{n.module}.{a.name}" for a in n.names} & modules.keys()
                    graph[name] |= subs or ({n.module} & modules.keys())
    return graph


def _layer(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module`."""
    best = max(((len(p), i) for i, layer in enumerate(LAYERS) for p in layer
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return best[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} -> {b}" for a, bs in sorted(graph.items()) for b in sorted(bs) if _layer(b) > _layer(a)]


def test_no_import_cycles_in_the_package():
    graph = _graph()
    assert len(graph) > 150 and graph["kvlab.gateway.server"]      # the walk found the package
    assert _cycles(graph) == []


def test_no_import_circle_even_through_imports_inside_functions():
    graph = _graph(lazy=True)
    assert "kvlab.scenarios.autoscale" in graph["kvlab.lab"] - _graph()["kvlab.lab"]   # lazy imports are walked
    assert _cycles(graph) == []


def test_no_module_imports_a_layer_above_its_own():
    assert _upward(_graph()) == []


def test_the_layer_check_finds_an_upward_import():
    assert _layer("kvlab.compare.results") < _layer("kvlab.run.routers") < _layer("kvlab.compare.command")
    assert _upward({"kvlab.run.phases": {"kvlab.report.html"}, "kvlab.report.html": {"kvlab.run.phases"}}) == [
        "kvlab.run.phases -> kvlab.report.html"]


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_one_module_starts_child_processes():
    """`kvlab.process.Child.start` is the one launcher: no other module calls `subprocess.Popen`."""
    starting = set()
    for path in PKG.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and (getattr(n.func, "attr", None) == "Popen" or getattr(n.func, "id", None) == "Popen"):
                starting.add(_module(path))
    assert starting == {"kvlab.process"}
