"""Render an HTML page to PNG with headless Chromium (docs screenshots, browser tests)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def chromium() -> str | None:
    """The Chromium binary on PATH (Debian: chromium), or None."""
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def screenshot(html: Path, png: Path, width: int = 1400, height: int = 1000, budget_ms: int = 8000,
               timeout_s: float = 120.0) -> Path:
    """Load `html` (scripts run for up to `budget_ms` of virtual time) and save a PNG of the
    window. RuntimeError if Chromium is missing or writes nothing."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("no chromium binary on PATH (apt-get install chromium)")
    png = Path(png).absolute()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvlab-chromium-") as profile:
        argv = [binary, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", Path(html).absolute().as_uri()]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if not png.is_file() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}")
    return png


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlab.traces.screenshot PAGE.html OUT.png [--width W] [--height H]` (the README's
    picture of the report: scripts/readme-screenshot.sh)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvlab.traces.screenshot", description=main.__doc__)
    p.add_argument("html", type=Path)
    p.add_argument("png", type=Path)
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1000)
    args = p.parse_args(argv)
    print(screenshot(args.html, args.png, args.width, args.height, budget_ms=10000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
