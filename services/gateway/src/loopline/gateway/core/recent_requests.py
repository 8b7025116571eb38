"""This gateway's recent serving requests, for the dashboard (ui/views.py): their latency, for live
percentiles (Prometheus has the same requests as a histogram, http_metrics.LATENCY, whose buckets
are too coarse for a percentile a person reads), and the newest answers, with the adapter version
and replica that served each (``RecentAnswers``).

Bounded: the newest ``KEEP`` latencies, so a gateway answering thousands a second holds a few
hundred kilobytes, and its percentiles then cover the last few seconds rather than the whole minute.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from loopline.common.contracts.schemas import QUEUED_ROUTES

KEEP = 4096
# The requests that travel through the queue to a replica, and ScalarLM's generate: what "latency"
# means to someone watching the serving path (not a status page, not an event stream).
SERVING_PATHS = frozenset({*QUEUED_ROUTES, "/v1/generate"})


@dataclass(frozen=True)
class Percentiles:
    count: int  # requests within the window
    window_s: float
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None


class RecentLatency:
    def __init__(self, keep: int = KEEP):
        self._done: deque[tuple[float, float]] = deque(maxlen=keep)  # (finished at, seconds)

    def record(self, path: str, seconds: float) -> None:
        if path in SERVING_PATHS:
            self._done.append((time.monotonic(), seconds))

    def percentiles(self, window_s: float = 60.0) -> Percentiles:
        since = time.monotonic() - window_s
        latencies = sorted(s for at, s in list(self._done) if at >= since)

        def nth(q: float) -> float | None:
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

        return Percentiles(len(latencies), window_s, nth(0.50), nth(0.90), nth(0.99))


@dataclass(frozen=True)
class Answer:
    at: float  # wall clock
    route: str
    model: str  # what the client asked for: a model, a job hash, "latest"
    adapter: str | None  # the job whose adapter served it
    adapter_step: int | None  # ...and its version (checkpoint step)
    replica: str
    status: int
    owner: str | None  # the key that asked (auth/tenancy.py): a viewer sees its own


class RecentAnswers:
    def __init__(self, keep: int = 50):
        self.answers: deque[Answer] = deque(maxlen=keep)

    def add(self, answer: Answer) -> None:
        self.answers.append(answer)


# One per process, as the Prometheus registry is: http_metrics.CountRequests records latencies,
# the OpenAI relay (openai/api.py) the answers.
RECENT = RecentLatency()
ANSWERS = RecentAnswers()
