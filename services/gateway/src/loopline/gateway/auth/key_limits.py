"""Per-key limits of one gateway process: a request rate (a token bucket per key) and a queue share
(how many of a key's requests this gateway holds at once, answered or waiting in the queue).

Both are per gateway: behind N gateways a key may make N times its rate and hold N times its share.
The state is in memory, one small entry per key name seen since the start (revoked keys' entries
stay; they are as many as keys ever made).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from loopline.gateway.auth.key_store import ApiKey


@dataclass
class TokenBucket:
    """``burst`` requests at once, refilled at ``per_s``; full when made."""

    per_s: float
    burst: int
    tokens: float = field(init=False)
    updated: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = float(self.burst)

    def take(self, now: float) -> float:
        """Take one token: 0.0 if taken, else the seconds until there is one."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.per_s


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after_s: int


class KeyLimits:
    def __init__(self, share_retry_after_s: int):
        # A slot's freeing cannot be foreseen: the gateway's usual Retry-After for a full queue.
        self.share_retry_after_s = share_retry_after_s
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}

    def admit(self, key: ApiKey) -> Refusal | None:
        """Count the request in (release it when answered), or say why not. The share is looked at
        first, so a request it refuses costs no token."""
        held = self._in_flight.get(key.name, 0)
        if key.max_in_flight is not None and held >= key.max_in_flight:
            return Refusal(f"API key {key.name!r} already has {held} requests in progress at this "
                           f"gateway, its limit (max_in_flight)", self.share_retry_after_s)
        if key.requests_per_minute is not None:
            wait_s = self._bucket(key).take(time.monotonic())
            if wait_s > 0:
                return Refusal(f"API key {key.name!r} is over its rate of {key.requests_per_minute:g} "
                               "requests per minute", max(1, math.ceil(wait_s)))
        self._in_flight[key.name] = held + 1
        return None

    def release(self, key: ApiKey) -> None:
        held = self._in_flight.get(key.name, 0) - 1
        if held > 0:
            self._in_flight[key.name] = held
        else:
            self._in_flight.pop(key.name, None)

    def _bucket(self, key: ApiKey) -> TokenBucket:
        assert key.requests_per_minute is not None
        per_s = key.requests_per_minute / 60.0
        # Unset burst: a second's worth of requests, at least one.
        burst = key.burst or max(1, math.ceil(per_s))
        bucket = self._buckets.get(key.name)
        if bucket is None or bucket.per_s != per_s or bucket.burst != burst:  # new, or its limits changed
            bucket = self._buckets[key.name] = TokenBucket(per_s, burst)
        return bucket
