"""kvlab's default sampler: at most N new traces a second, children follow their parent; chosen when
OTEL_TRACES_SAMPLER is unset, by name through the SDK's entry points, and by the SDK's own configurator."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk._configuration import _import_sampler
from opentelemetry.sdk.trace.sampling import Decision, ParentBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvlab.telemetry import sampling
from kvlab.telemetry.sampling import DEFAULT, RateLimited, parentbased_ratelimited


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def decide(sampler, parent: Context | None = None) -> bool:
    return sampler.should_sample(parent, 0x1234, "root").decision is Decision.RECORD_AND_SAMPLE


def test_roots_are_capped_per_second_and_children_follow_their_parent(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(sampling, "monotonic", clock)
    sampler = parentbased_ratelimited("5")
    assert sum(decide(sampler) for _ in range(100)) == 5           # one second's worth at once
    clock.now += 0.5
    assert sum(decide(sampler) for _ in range(100)) == 2           # refilled at 5 a second (2.5 tokens)
    clock.now += 60                                                # idle: the bucket holds one second
    assert sum(decide(sampler) for _ in range(100)) == 5
    # the bucket is empty now; a sampled parent's child is still sampled, an unsampled one's is not
    for flags, sampled in ((TraceFlags.SAMPLED, True), (TraceFlags.DEFAULT, False)):
        parent = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(flags))
        assert decide(sampler, trace.set_span_in_context(NonRecordingSpan(parent))) is sampled
    assert sampler.get_description() == "ParentBased{root:RateLimited{5/s},remoteParentSampled:AlwaysOnSampler," \
        "remoteParentNotSampled:AlwaysOffSampler,localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"


def test_a_sampled_root_keeps_the_attributes_it_started_with():
    """The SDK's span starts with the attributes its sampler returns."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider(sampler=parentbased_ratelimited("5")).get_tracer("t")
    with tracer.start_as_current_span("root", attributes={"gen_ai.operation.name": "chat"}) as span:
        assert span.attributes == {"gen_ai.operation.name": "chat"}


def test_a_rate_below_one_a_second_still_samples_now_and_then(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(sampling, "monotonic", clock)
    sampler = RateLimited(0.5)
    assert [decide(sampler) for _ in range(3)] == [True, False, False]
    clock.now += 2
    assert decide(sampler)
    with pytest.raises(ValueError):
        RateLimited(0)


def test_the_sdks_own_configurator_resolves_the_entry_point():
    """opentelemetry-instrument's way (OTEL_TRACES_SAMPLER through the entry points) finds ours."""
    sampler = _import_sampler(DEFAULT)
    assert isinstance(sampler, ParentBased) and "RateLimited{200/s}" in sampler.get_description()


PROBE = r"""
import json
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from kvlab.telemetry.setup import configure_tracing

provider = configure_tracing("probe-sampling")
tracer = trace.get_tracer("probe")
roots = 0
for _ in range(300):
    with tracer.start_as_current_span("root") as span:
        roots += span.get_span_context().trace_flags.sampled
remote = SpanContext(0xabc, 0xdef, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
children = 0
for _ in range(300):
    with tracer.start_as_current_span("child", context=trace.set_span_in_context(NonRecordingSpan(remote))) as span:
        children += span.get_span_context().trace_flags.sampled
print(json.dumps({"roots": roots, "children": children, "provider": type(provider).__name__,
                  "sampler": provider.sampler.get_description()}))
"""


def probe(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVLAB_TRACES"))}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**base, "OTEL_TRACES_EXPORTER": "none", **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


@pytest.mark.parametrize("export_process", ["0", "1"])   # the SDK's TracerProvider, kvlab's recorder
@pytest.mark.parametrize(("env", "roots", "warning"), [
    ({}, 200, None),                                                            # unset: kvlab's default
    ({"OTEL_TRACES_SAMPLER": DEFAULT, "OTEL_TRACES_SAMPLER_ARG": "20"}, 20, None),   # by name, via entry point
    ({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, 300, None),             # the SDK's own names still work
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, 0, None),
    ({"OTEL_TRACES_SAMPLER": "no-such-sampler"}, 200, "OTEL_TRACES_SAMPLER=no-such-sampler"),
    ({"OTEL_TRACES_SAMPLER": DEFAULT, "OTEL_TRACES_SAMPLER_ARG": "-3"}, 200, "OTEL_TRACES_SAMPLER_ARG='-3'"),
])
@pytest.mark.processes
def test_processes_sample_what_the_environment_says(export_process, env, roots, warning):
    out = probe({"KVLAB_TRACES_EXPORT_PROCESS": export_process, **env})
    assert out["provider"] == ("RecorderProvider" if export_process == "1" else "TracerProvider")
    # 300 roots in well under a second: the bucket's one second's worth, plus what refilled meanwhile
    assert roots <= out["roots"] <= roots * 1.25 + 1, out
    assert out["children"] == 300            # a sampled parent's children are always kept
    if warning:
        assert warning in out["stderr"]
