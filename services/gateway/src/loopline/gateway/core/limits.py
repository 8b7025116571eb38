"""Refusals of a client-controlled size beyond its limit. Each names the limit and the setting that
raises it (``LOOPLINE_*``): the client learns what was too much, the operator what to change.

Every size a client chooses (how many samples, ids, chunks, list entries, streams; how long a line)
is checked against its limit before any work is done for it: one request must not be able to make
the gateway allocate in proportion to a number it picked.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

from fastapi import Request

from loopline.gateway.auth.api_keys import api_key_of
from loopline.gateway.auth.key_limits import TokenBucket
from loopline.gateway.core.errors import ApiError


def setting_env(field: str) -> str:
    """The environment variable of a GatewaySettings field (settings.py maps them by upper-casing)."""
    return f"LOOPLINE_{field.upper()}"


def over_limit(status: int, what: str, limit: int, field: str, *, param: str | None = None) -> ApiError:
    """``what`` (the offending size, in the client's words) refused: the limit and its setting."""
    return ApiError(status, f"{what}; the limit is {limit} (`{setting_env(field)}`)", param=param)


def check_count(value: object, limit: int, field: str, param: str, *, status: int = 400) -> None:
    """A count the client sent (``n``, ``num_samples``): a positive integer no larger than ``limit``.
    Anything but an int is left to whoever reads it (vLLM answers its own 400 for ``n="x"``)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return
    if value < 1:
        raise ApiError(400, f"{param}={value}: must be at least 1", param=param)
    if value > limit:
        raise over_limit(status, f"{param}={value} is too many", limit, field, param=param)


def check_page(limit: int, offset: int, max_limit: int) -> None:
    """A list route's ``limit`` and ``offset``: 0 or more, and no more entries than ``max_limit``
    (a negative one would slice from the end, silently answering something else than was asked)."""
    for name, value in (("limit", limit), ("offset", offset)):
        if value < 0:
            raise ApiError(400, f"{name}={value}: must be 0 or more", param=name)
    if limit > max_limit:
        raise over_limit(400, f"limit={limit} is too many entries for one page", max_limit, "max_list_limit",
                         param="limit")


def holder_of(request: Request) -> str:
    """Who a per-key limit counts a request against: its API key, or without keys its client's
    address (one user's machine under `make up`; behind a proxy, the proxy: one count for all)."""
    key = api_key_of(request)
    if key is not None:
        return f"key {key.name!r}"
    return f"client {request.client.host if request.client else 'unknown'}"


# Per-client tables remember this many holders unless told otherwise (GatewaySettings'
# max_tracked_clients).
MAX_HOLDERS = 10_000

V = TypeVar("V")


class RecentHolders(Generic[V]):
    """Each holder's entry, for the ``limit`` holders seen most recently: one seen longer ago is
    forgotten (its quota starts afresh), so clients with many addresses cannot grow the table."""

    def __init__(self, make: Callable[[], V], limit: int = MAX_HOLDERS):
        self.make, self.limit = make, limit
        self.entries: OrderedDict[str, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def of(self, holder: str) -> V:
        entry = self.entries.get(holder)
        if entry is None:
            entry = self.entries[holder] = self.make()
            while len(self.entries) > self.limit:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(holder)
        return entry


class WindowQuota:
    """At most ``limit`` creations per holder within ``window_s``, counted at this gateway: with a
    TTL of ``window_s`` on what is created, it bounds what one holder keeps (per gateway)."""

    def __init__(self, limit: int, window_s: float, field: str, what: str, *, max_holders: int = MAX_HOLDERS):
        self.limit, self.window_s, self.field, self.what = limit, window_s, field, what
        self.times: RecentHolders[deque[float]] = RecentHolders(deque, max_holders)

    def take(self, request: Request) -> None:
        holder = holder_of(request)
        now = time.monotonic()
        times = self.times.of(holder)
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.limit:
            retry = math.ceil(self.window_s - (now - times[0]))
            error = over_limit(429, f"{holder} created {len(times)} {self.what} in the last "
                                    f"{self.window_s:g} s", self.limit, self.field)
            error.headers["Retry-After"] = str(max(retry, 1))
            raise error
        times.append(now)


class RateQuota:
    """At most ``per_minute`` requests per holder, in bursts of up to a tenth of that (a token
    bucket each), counted at this gateway: keys or none, so a client without keys is bounded too."""

    def __init__(self, per_minute: int, field: str, what: str, *, max_holders: int = MAX_HOLDERS):
        self.per_minute, self.field, self.what = per_minute, field, what
        per_s = per_minute / 60.0
        self.burst = burst = max(1, per_minute // 10)
        self.buckets: RecentHolders[TokenBucket] = RecentHolders(lambda: TokenBucket(per_s, burst),
                                                                 max_holders)

    def take(self, request: Request) -> None:
        holder = holder_of(request)
        wait_s = self.buckets.of(holder).take(time.monotonic())
        if wait_s > 0:
            error = over_limit(429, f"{holder} is over its rate of {self.what} per minute (in bursts of "
                                    f"at most {self.burst})", self.per_minute, self.field)
            error.headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
            raise error
