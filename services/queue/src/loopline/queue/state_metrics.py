"""The queue's Prometheus metrics of its admission state: each deployment's depth and whether the
gateways are refusing it, read from the state last published on ``queue.state`` when scraped."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from loopline.common.contracts.schemas import QueueState


def state_families(state: QueueState | None) -> list[Metric]:
    """The gauges of ``state``; without samples when there is none yet (see StateCollector)."""
    depth = GaugeMetricFamily("loopline_queue_depth", (
        "Requests waiting or running (taken by a replica, not yet answered), by deployment."),
        labels=["deployment"])
    in_flight = GaugeMetricFamily("loopline_queue_in_flight", (
        "Requests taken by a replica and not yet answered, by deployment."), labels=["deployment"])
    full = GaugeMetricFamily("loopline_queue_full", (
        "1 while a deployment's depth is at the limit: the gateways answer its requests 429."),
        labels=["deployment"])
    max_depth = GaugeMetricFamily("loopline_queue_max_depth", (
        "Admission's limit on each deployment's depth (LOOPLINE_MAX_QUEUE_DEPTH)."))
    measured = GaugeMetricFamily("loopline_queue_state_timestamp_seconds", (
        "When the admission state was last measured and published (Unix time): a stale one means "
        "the gateways admit everything."))
    if state is not None:
        for deployment, load in state.deployments.items():
            depth.add_metric([deployment], load.depth)
            in_flight.add_metric([deployment], load.in_flight)
            full.add_metric([deployment], 1 if load.depth >= state.max_depth else 0)
        max_depth.add_metric([], state.max_depth)
        measured.add_metric([], state.at)
    return [depth, in_flight, full, max_depth, measured]
