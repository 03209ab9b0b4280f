"""The installed environment is what the packages shipped: xds-protos (`kvlab epp`) carries its own
copies of opentelemetry-proto's generated modules, and whichever is installed last wins. `make
venv-dev` re-installs opentelemetry-proto's files (`make otel-proto`); this test fails if they were
overwritten, before every OTLP export test fails with a less obvious import error."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata


def test_opentelemetry_proto_files_are_its_own():
    dist = importlib.metadata.distribution("opentelemetry-proto")
    changed = []
    for f in dist.files or []:
        if f.hash is None or not f.name.endswith(".py"):
            continue
        digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, f.locate().read_bytes()).digest()).rstrip(b"=")
        if digest.decode() != f.hash.value:
            changed.append(str(f))
    assert not changed, (f"{len(changed)} opentelemetry-proto files were overwritten (xds-protos installed after it?): "
                         f"{changed[:3]}; run `make otel-proto`")
