"""OpenTelemetry set-up, and W3C trace context carried in NATS headers.

The gateway starts a span per HTTP request and injects ``traceparent`` into the headers of what it
publishes; the service that consumes the message extracts it, so one trace spans the hops.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger(__name__)


def setup_tracing(service: str, otlp_endpoint: str | None = None, exporter: SpanExporter | None = None) -> None:
    """Install a tracer provider for this process. Without an endpoint or exporter spans are
    created (so context still propagates) but not exported anywhere."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is None and otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:  # the exporter is an optional extra
            log.warning("LOOPLINE_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed")
        else:
            exporter = OTLPSpanExporter(endpoint=otlp_endpoint)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_trace_headers(headers: MutableMapping[str, str]) -> None:
    """Add ``traceparent`` (and ``tracestate``) of the current span to outgoing NATS headers."""
    propagate.inject(headers)


def context_from_headers(headers: Mapping[str, str] | None) -> context.Context:
    """The trace context a message was published under, to parent the consumer's span."""
    return propagate.extract(dict(headers or {}))
