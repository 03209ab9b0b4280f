"""Shared pytest fixtures and the CI rule: under CI=true a test that needs an installed part
(vLLM, Prometheus, Chromium) fails instead of skipping, so CI can never pass by skipping."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require(condition: bool, what: str) -> None:
    """Skip (locally) or fail (in CI) when a needed part is missing."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI must provide {what}")
        pytest.skip(f"needs {what}")


def require_binary(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"the `{name}` binary on PATH")
    return path  # type: ignore[return-value]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()
