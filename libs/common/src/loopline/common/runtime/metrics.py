"""Prometheus metrics of a Loopline process: the ``/metrics`` server every service runs, the text
the gateway also serves on its own port, and the shared latency buckets.

Every process keeps its metrics in prometheus_client's default ``REGISTRY``: the services' own
(``loopline_*``, defined next to the code that counts them), the Python process and GC collectors
prometheus_client adds, and in an inference replica vLLM's engine metrics (``vllm:*``), which vLLM
registers there too. The runtime serves that registry on ``LOOPLINE_METRICS_PORT``
(``serve_metrics``); a metric whose value is a state held elsewhere (a queue depth, a table's rows)
is a ``StateCollector`` read at scrape time, so it is never stale and costs nothing between scrapes.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, Info, start_http_server
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

State = TypeVar("State")

PATH = "/metrics"
# Seconds, for HTTP requests and adapter loads: from the gateway's own ~1 ms (what it adds to a
# request; the serving bench's budget is 5 ms) to a ScalarLM long poll (60 s) and beyond.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, float("inf"))
# Set by the runtime: which service and replica a scrape reached (joins its series to $SRV's view).
SERVICE = Info("loopline_service", "This process: its service role, replica id and Loopline version.")


@dataclass
class MetricsServer:
    """prometheus_client's own HTTP server, answering scrapes on a daemon thread of its own: a
    scrape never waits for the event loop, and the thread cannot keep a stopping process alive."""

    url: str
    httpd: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        """Stop answering; blocking for up to its poll interval (0.5 s), so call it off the loop."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve_metrics(port: int) -> MetricsServer | None:
    """Serve the default registry on ``port`` (0: a free one), every interface, as Prometheus
    exporters do; None when ``port`` is negative (off). Raises OSError when the port is taken."""
    if port < 0:
        return None
    httpd, thread = start_http_server(port, addr="0.0.0.0")
    url = f"http://{socket.gethostname()}:{httpd.server_address[1]}{PATH}"
    return MetricsServer(url, httpd, thread)


def exposition(accept: str | None) -> tuple[bytes, str]:
    """The default registry in the format the ``Accept`` header asks for (Prometheus text unless
    it asks for OpenMetrics), and its content type."""
    encode, content_type = choose_encoder(accept or "")
    return encode(REGISTRY), content_type


class StateCollector(Collector, Generic[State]):
    """Metrics of a live state, read when scraped: ``families(read())``, the metric families with
    their samples. ``describe`` gives ``families(None)``, the families without samples, so that
    registering one does not read the state."""

    def __init__(self, read: Callable[[], State], families: Callable[[State | None], Iterable[Metric]]):
        self._read, self._families = read, families

    def collect(self) -> Iterable[Metric]:
        try:
            state = self._read()
        except Exception:  # a database down must not fail the scrape of every other metric
            log.warning("reading metrics failed; this scrape leaves them out", exc_info=True)
            return []
        return list(self._families(state))

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))


def register(collector: Collector) -> Callable[[], None]:
    """Add ``collector`` to the default registry; returns what removes it (for ``rt.on_stop``)."""
    REGISTRY.register(collector)
    return lambda: REGISTRY.unregister(collector)
