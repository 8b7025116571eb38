"""ScalarLM's /v1/generate/metrics figures, from the ledger's totals and the latest queue depth."""

from __future__ import annotations

from loopline.common.contracts.schemas import QueueMetrics, QueueState
from loopline.queue.records import LedgerTotals


def queue_depth(state: QueueState | None) -> int:
    if state is None:
        return 0
    return sum(load.depth for load in state.deployments.values())


def queue_metrics(totals: LedgerTotals, state: QueueState | None) -> QueueMetrics:
    # The span the rates are averaged over: first prompt enqueued to last prompt answered.
    span = 0.0
    if totals.first_enqueued_at is not None and totals.last_completed_at is not None:
        span = max(0.0, totals.last_completed_at - totals.first_enqueued_at)
    return QueueMetrics(
        queue_depth=queue_depth(state),
        requests=totals.completed,
        tokens=totals.completion_tokens,
        total_time=span,
        token_per_s=totals.completion_tokens / span if span > 0 else 0.0,
        request_per_s=totals.completed / span if span > 0 else 0.0,
        failed=totals.failed,
    )
