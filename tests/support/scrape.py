"""Scrape a Loopline process's ``/metrics`` as Prometheus would, and read samples out of it."""

from __future__ import annotations

import httpx
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loopline.common.contracts.schemas import ServiceStatus


def scrape(url: str) -> list[Sample]:
    """Every sample at ``url`` (Prometheus text format, parsed by prometheus_client's own parser)."""
    resp = httpx.get(url, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain"), resp.headers
    return [sample for family in text_string_to_metric_families(resp.text) for sample in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels``; None when there is none."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples: give more labels"
    return found[0] if found else None


async def metrics_url(nc: NATS, status_subject: str) -> str:
    """Where the service answering on ``status_subject`` serves /metrics: its status says."""
    reply = await nc.request(status_subject, b"{}", timeout=10)
    return ServiceStatus.model_validate_json(reply.data).detail["metrics_url"]
