"""Internal records the queue service passes between its loops and its SQL writer.

They are neither wire schemas (those live in ``loopline.common.contracts.schemas``) nor SQL rows (those live
in ``loopline.common.db.rows``): a field here can change without touching a message or a table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class MaxDeliveriesAdvisory:
    """JetStream's notice that a consumer gave up on one message after ``deliveries`` attempts."""

    stream: str
    consumer: str
    stream_seq: int
    deliveries: int

    @classmethod
    def from_json(cls, data: bytes) -> MaxDeliveriesAdvisory:
        doc = json.loads(data)
        return cls(
            stream=str(doc["stream"]),
            consumer=str(doc["consumer"]),
            stream_seq=int(doc["stream_seq"]),
            deliveries=int(doc["deliveries"]),
        )


@dataclass(frozen=True)
class DeadLetter:
    """A work item no replica completed, kept after it was failed so someone can look at it."""

    request_id: str
    stream_seq: int
    deliveries: int
    payload: str
    failed_at: float


@dataclass(frozen=True)
class LedgerTotals:
    """The ledger-wide aggregates the metrics endpoint is computed from."""

    completed: int
    failed: int
    completion_tokens: int
    # None while the ledger is empty / nothing has completed yet.
    first_enqueued_at: float | None
    last_completed_at: float | None
