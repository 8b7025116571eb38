"""Trace context crosses NATS: a span started by the publisher parents the consumer's span."""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loopline.common.contracts import subjects
from loopline.common.runtime import bus, telemetry


async def test_trace_context_travels_in_nats_headers(nats_url):
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("test", exporter=exporter)
    provider = trace.get_tracer_provider()
    tracer = telemetry.tracer("test")
    nc = await bus.connect(nats_url, "telemetry-test")
    js = nc.jetstream()
    await bus.ensure_topology(js)
    received: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_msg(msg):
        received.set_result(msg.headers)

    await nc.subscribe(subjects.result("trace", 0), cb=on_msg)
    with tracer.start_as_current_span("publisher") as parent:
        await bus.publish_durable(js, subjects.result("trace", 0), b"{}", msg_id="trace-test")
    headers = await asyncio.wait_for(received, 5)
    assert headers["Nats-Msg-Id"] == "trace-test" and "traceparent" in headers
    with tracer.start_as_current_span("consumer", context=telemetry.context_from_headers(headers)) as child:
        pass
    provider.force_flush()
    await nc.close()
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    assert child.parent.span_id == parent.get_span_context().span_id
    assert {s.name for s in exporter.get_finished_spans()} == {"publisher", "consumer"}


def test_without_an_exporter_spans_are_not_recorded_but_ids_still_flow():
    # The set-up every service runs when LOOPLINE_OTLP_ENDPOINT is unset.
    tracer = telemetry.tracer_provider("test").get_tracer("test")
    headers: dict[str, str] = {}
    with tracer.start_as_current_span("publisher") as parent:
        assert not parent.is_recording()
        telemetry.inject_trace_headers(headers)
    assert parent.get_span_context().is_valid and "traceparent" in headers
    with tracer.start_as_current_span("consumer", context=telemetry.context_from_headers(headers)) as child:
        pass
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
