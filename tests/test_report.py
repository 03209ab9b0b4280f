"""The HTML report: self-contained, and rendered by headless Chromium without JavaScript errors."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import pytest

from conftest import phase_result, require, require_binary
from kvlab.load.measure import Record
from kvlab.report import write_report

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
# injected before anything else runs: every uncaught error is recorded on <html data-js-errors>
CATCHER = ("<script>window.addEventListener('error',function(e){var h=document.documentElement;"
           "h.setAttribute('data-js-errors',(h.getAttribute('data-js-errors')||'')+e.message+'|')});</script>")


def phases(seed: int = 0) -> dict:
    rng = random.Random(seed)
    out = {}
    for phase, hit_p, base in (("round-robin", 0.3, 500.0), ("kv-aware", 0.9, 50.0)):
        recs = []
        for i in range(200):
            hit = rng.random() < hit_p
            recs.append(Record(ts=1000 + i * 0.1, ttft_ms=(base / 5 if hit else base) * rng.uniform(0.8, 1.5),
                               itl_ms=12.0, tpot_ms=12.0, e2e_ms=600.0, prompt_tokens=1900,
                               output_tokens=32, cached_tokens=1850 if hit else 0, available_tokens=1850,
                               predicted_tokens=1850 if hit else 0, replica=f"sim-{i % 4}", error=None))
        out[phase] = phase_result(phase, recs)
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    return write_report(tmp_path_factory.mktemp("report") / "report.html", phases(), {"run": "test"})


def test_report_is_self_contained_with_the_figures(report):
    html = report.read_text()
    assert not re.search(r"<script[^>]+src=", html)       # plotly.js inlined: works offline
    assert html.count("Plotly.newPlot") == 5
    summary = json.loads(re.search(r'id="kvlab-summary">(.*?)</script>', html, re.S).group(1))
    assert summary["kv-aware"]["hit_rate"]["delivered"] > summary["round-robin"]["hit_rate"]["delivered"]
    assert "TTFT p50" in html and "lower" in html
    assert "<h1>kvlab: round-robin vs kv-aware</h1>" in html   # the heading names what was compared


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    binary = require_binary("chromium")
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args],
                          capture_output=True, text=True, timeout=120)


def js_errors(dom: str) -> str | None:
    match = re.search(r'<html[^>]*data-js-errors="([^"]*)"', dom)
    return match.group(1) if match else None


def rendered_dom(tmp_path: Path, html: str) -> str:
    page = tmp_path / "page.html"
    page.write_text(html.replace("<head>", "<head>" + CATCHER, 1))
    result = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.browser
def test_report_renders_in_chromium_without_js_errors(report, tmp_path):
    dom = rendered_dom(tmp_path, report.read_text())
    assert js_errors(dom) is None
    assert dom.count('class="main-svg"') >= 5              # plotly drew every figure
    # the harness does catch errors: a page that throws is reported
    broken = rendered_dom(tmp_path, "<html><head></head><body><script>throw new Error('boom')</script></body></html>")
    assert "boom" in (js_errors(broken) or "")


@pytest.mark.browser
def test_report_screenshot_is_not_blank(report, tmp_path):
    shot = tmp_path / "report.png"
    result = chromium(tmp_path, "--window-size=1280,2000", f"--screenshot={shot}", report.as_uri())
    assert shot.exists(), result.stderr[-2000:]
    try:
        from PIL import Image
    except ImportError:
        require(False, "pillow (the dev extra)")
    image = Image.open(shot).convert("RGB")
    colors = image.getcolors(maxcolors=1 << 20) or []
    non_white = sum(n for n, c in colors if sum(c) < 3 * 235)
    assert len(colors) > 50 and non_white > 0.02 * image.width * image.height
    # the two phase colours of the figures are on screen
    reds = sum(n for n, (r, g, b) in colors if r > 180 and g < 80 and b < 80)
    greens = sum(n for n, (r, g, b) in colors if g > 130 and r < 90 and b < 90)
    assert reds > 500 and greens > 500


def test_throughput_over_days_of_virtual_time_keeps_its_bins_few():
    # the twin's virtual time can span days (a sparse trace): 2-s bins over 10^12 s were terabytes
    from kvlab.report.figures import throughput
    recs = [Record(ts=t, e2e_ms=500.0, error=None) for t in (0.0, 10.0, 1e7)]
    (line,) = throughput({"kv-aware": recs}).data
    assert len(line.x) <= 2000 and sum(y * (line.x[1] - line.x[0]) for y in line.y) == pytest.approx(3)
    (short,) = throughput({"kv-aware": recs[:2]}).data
    assert short.x[1] - short.x[0] == 2.0   # runs under about an hour keep 2-s bins
