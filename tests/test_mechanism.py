"""The mechanism pictures (kvlab.traces.mechanism) from a run's files: the chained-hash figure from
the workload's real token ids, residency and evictions from the decision spans, three decisions in
words; the report embeds them, each figure with a heading and a caption, and headless Chromium draws
every one with no toolbar over a title (lab 02 calls the same `mechanism.figures`)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import phase_result, require
from kvlab.kvcache.hashing import block_keys
from kvlab.load.measure import Record
from kvlab.report import write_report
from kvlab.telemetry import names as n
from kvlab.telemetry.sink import SpanFile
from kvlab.traces import mechanism
from kvlab.traces.sources.otlp_files import OtlpFileSource

WORKLOAD = {"name": "shared-prefix", "seed": 0,
            "params": {"groups": 3, "prompts_per_group": 4, "system_tokens": 200, "question_tokens": 24}}
WEIGHTS = {"prefix": 3.0, "queue": 1.0, "kv_usage": 0.5, "inflight": 1.0}
PROMPT = 240


def cand(replica: str, prefix: int, inflight: int = 0) -> dict:
    return {"replica": replica, "prefix_tokens": prefix, "speculative_tokens": 0, "waiting": 0, "running": inflight,
            "kv_usage": 0.1, "inflight": inflight, "inflight_tokens": 0, "pending_prefill_tokens": 0,
            "prefill_ms_per_token": None, "filtered": False,
            "scores": {"prefix": prefix / PROMPT, "queue": 1.0, "kv_usage": 0.9, "inflight": 1.0 - inflight / 2},
            "total": 3 * prefix / PROMPT + 1.45 + 1.0 - inflight / 2}


# (policy, group, chosen, reason, candidates, cached tokens delivered)
REQUESTS = [
    ("round-robin", "g0", "sim-0", "round-robin", [cand("sim-0", 0), cand("sim-1", 0)], 0),
    ("round-robin", "g0", "sim-1", "round-robin", [cand("sim-0", 224), cand("sim-1", 0)], 0),
    ("round-robin", "g1", "sim-0", "round-robin", [cand("sim-0", 0), cand("sim-1", 0)], 0),
    # g0's blocks left sim-0 (evicted for g1): its index prefix drops from 224 to 0
    ("round-robin", "g0", "sim-0", "round-robin", [cand("sim-0", 0), cand("sim-1", 224)], 0),
    ("kv-aware", "g0", "sim-0", "load", [cand("sim-0", 0), cand("sim-1", 0)], 0),
    ("kv-aware", "g0", "sim-0", "prefix", [cand("sim-0", 224), cand("sim-1", 0)], 224),
    ("kv-aware", "g1", "sim-1", "load-over-prefix", [cand("sim-0", 224, inflight=2), cand("sim-1", 160)], 160),
]


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict]:
    """A run directory as `kvlab lab` leaves it: summary.json, phase records, span files."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kvlab-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("kvlab.gateway")
    records: dict[str, list[Record]] = {"round-robin": [], "kv-aware": []}
    for i, (policy, group, chosen, reason, cands, delivered) in enumerate(REQUESTS):
        with tracer.start_as_current_span(n.SPAN_GATEWAY_REQUEST) as root:
            root.set_attributes({n.POLICY: policy, n.PROMPT_TOKENS: PROMPT, n.REPLICA: chosen,
                                 n.PREFIX_DELIVERED_TOKENS: delivered})
            with tracer.start_as_current_span(n.SPAN_SCHEDULE) as s:
                s.set_attributes({n.SCHEDULE_CANDIDATES: json.dumps(cands), n.SCHEDULE_CHOSEN: chosen,
                                  n.SCHEDULE_WEIGHTS: json.dumps(WEIGHTS), n.SCHEDULE_REASON: reason,
                                  n.SCHEDULE_SHADOW: policy == "round-robin", n.POLICY: policy,
                                  n.PREFIX_AVAILABLE_TOKENS: max(c["prefix_tokens"] for c in cands),
                                  n.PREFIX_PREDICTED_TOKENS: next(c["prefix_tokens"] for c in cands
                                                                  if c["replica"] == chosen)})
            records[policy].append(Record(
                ts=1000.0 + i, trace_id=format(root.get_span_context().trace_id, "032x"), group=group,
                replica=chosen, ttft_ms=100.0 if delivered else 900.0, itl_ms=10.0, tpot_ms=10.0,
                e2e_ms=1000.0, prompt_tokens=PROMPT, output_tokens=8, cached_tokens=delivered,
                available_tokens=max(c["prefix_tokens"] for c in cands), error=None,
                predicted_tokens=next(c["prefix_tokens"] for c in cands if c["replica"] == chosen)))
    root = tmp_path / "run"
    (root / "traces").mkdir(parents=True)
    sink = SpanFile(root / "traces")
    sink.write(encode_spans(exporter.get_finished_spans()))
    sink.close()
    phases = {p: phase_result(p, recs) for p, recs in records.items()}
    (root / "summary.json").write_text(json.dumps({"workload": WORKLOAD, "policies": list(phases),
                                                   "topology": {"sim": {"block_size": 16}}}))
    return root, phases


def test_chain_figure_from_the_workloads_token_ids():
    prompts = mechanism.prompt_tokens(WORKLOAD["name"], WORKLOAD["seed"], WORKLOAD["params"], n=12)
    (_, a), b = prompts[0], next(t for g, t in prompts[1:] if g == prompts[0][0] and t != prompts[0][1])
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    fig = mechanism.chain_figure(a, b, 16, flip_at=20)
    rows = fig.data[0].z
    assert rows[0] == [1.0] * len(block_keys(a, 16))                     # A against itself
    assert rows[1][: common // 16] == [1.0] * (common // 16)              # B shares every block before it differs
    assert rows[1][common // 16] == 0.0
    assert rows[2][:1] == [1.0] and set(rows[2][1:]) == {0.0}             # token 20 is in block 1: all later keys differ
    assert f"first {common // 16} blocks" in fig.layout.title.text


def test_residency_counts_evictions_and_spread(run):
    root, phases = run
    traces = OtlpFileSource(root / "traces").traces()
    res = mechanism.residency(traces, [r for v in phases.values() for r in v.records])
    rr, kv = res["round-robin"], res["kv-aware"]
    assert rr.evictions == {("g0", "sim-0"): 1} and kv.evictions == {}
    assert rr.groups == ["g0", "g1"] and rr.replicas == ["sim-0", "sim-1"]
    assert rr.states[-1][("g0", "sim-1")] == pytest.approx(224 / PROMPT)
    fig = mechanism.residency_figure(res)
    assert len(fig.data) == 2 and fig.layout.annotations[0].text == "round-robin: 1 eviction seen"
    assert fig.layout.annotations[1].text == "kv-aware: no eviction seen"
    assert len(fig.layout.sliders[0].steps) == 11


def test_pictures_and_examples(run):
    root, phases = run
    figs, decisions = mechanism.figures(root, phases)
    assert [p.caption for p in figs] == [mechanism.CHAIN_CAPTION, mechanism.RESIDENCY_CAPTION]
    assert len(decisions) == len(REQUESTS)
    ex = mechanism.examples(decisions)
    assert ex["a hit"].reason == "prefix" and ex["a round-robin miss"].policy == "round-robin"
    assert ex["load over cache"].chosen == "sim-1"
    words = mechanism.examples_html(decisions)
    assert "round-robin sent it to sim-1" in words and "kv-aware would have picked sim-0" in words
    assert "sim-1 won by" in words   # load over cache: fewer in-flight requests beat a longer prefix
    # a run without one of the three kinds shows the others, not "none in this run"
    words = mechanism.examples_html([d for d in decisions if d.reason != "load-over-prefix"])
    assert "load over cache" not in words and "none" not in words and "a hit" in words


def test_report_section_only_for_a_run_directory(run, tmp_path: Path):
    root, phases = run
    assert mechanism.section(None, phases, {}) == "" and mechanism.section(tmp_path, phases, {}) == ""
    html = write_report(root / "report.html", phases, {"run": "t"}).read_text()
    assert "Why: the mechanism in this run" in html and html.count("Plotly.newPlot") == 7
    # every figure: its title as a heading above, a caption under it
    assert html.count('<figure class="fig">') == 7 and html.count("<figcaption>") == 7
    (root / "summary.json").write_text("{not json")          # a damaged run still gets its report
    html = write_report(root / "report.html", phases, {"run": "t"}).read_text()
    assert "could not be drawn" in html and html.count("Plotly.newPlot") == 5


OVERLAPS = """<script>window.addEventListener('load', function () { setTimeout(function () {
  function hit(a, b) { return a.width > 0 && b.width > 0 && a.left < b.right && b.left < a.right &&
                              a.top < b.bottom && b.top < a.bottom; }
  var out = {plots: 0, modebars: 0, covered: []};
  document.querySelectorAll('.js-plotly-plot').forEach(function (plot, i) {
    out.plots += 1;
    var bar = plot.querySelector('.modebar');
    if (!bar) return;
    out.modebars += 1;
    var r = bar.getBoundingClientRect();
    plot.querySelectorAll('.gtitle, .annotation-text, .g-gtitle text').forEach(function (t) {
      if (hit(r, t.getBoundingClientRect())) out.covered.push(i + ': ' + t.textContent);
    });
  });
  var pre = document.createElement('pre'); pre.id = 'kvlab-overlaps';
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre); }, 3000); });
</script>"""


@pytest.mark.browser
def test_report_draws_every_figure_in_chromium_with_no_toolbar_over_a_title(run, tmp_path: Path):
    from kvlab.traces.screenshot import FLAGS, chromium

    binary = chromium()
    require(binary is not None, "the chromium binary")
    root, phases = run
    page = write_report(root / "report.html", phases, {"run": "t"})
    page.write_text(page.read_text().replace("</head>", OVERLAPS + "</head>", 1))
    proc = subprocess.run([binary, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000",
                           "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    dom = proc.stdout
    section = dom.split('class="mechanism"', 1)[1].split("</ul>", 1)[0]
    plots = section.split("plotly-graph-div")[1:]
    assert len(plots) == 2, "chain and residency figures in the section"
    for name, chunk in zip(("chain", "residency"), plots):
        assert 'class="main-svg"' in chunk, f"the {name} figure was not drawn"
    assert re.search(r'class="hm"|<image', plots[0]) and re.search(r'class="hm"|<image', plots[1]), "heatmaps drawn"
    found = re.search(r'<pre id="kvlab-overlaps">(.*?)</pre>', dom, re.S)
    assert found, "the page did not finish loading in Chromium"
    seen = json.loads(found.group(1).replace("&quot;", '"'))
    assert seen["plots"] == 7 and seen["modebars"] == 7, seen
    assert seen["covered"] == [], f"the plot toolbar covers: {seen['covered']}"
