"""Asking a Loopline service over NATS request-reply (nats.micro), and reading its answer or refusal.

A service refuses a request with nats.micro's error headers, the HTTP status it means as the code
(the trainer's endpoints do: "404", "409", "422"). Every way a request can fail becomes one
``ServiceError`` carrying the HTTP status a caller should answer with: the service's own 4xx or 5xx,
503 when nobody serves the subject or the bus is down, 504 when the service is too slow, 502 when
its answer makes no sense. The gateway answers its clients with that status; the tests read it
from the same client, so both see the service as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER
from pydantic import BaseModel, ValidationError

Reply = TypeVar("Reply", bound=BaseModel)


class ServiceError(Exception):
    """A request that got no usable answer. ``status`` is the HTTP status it means, ``message`` says
    why (the service's own words when it refused), ``retry_after_s`` is set when trying again soon
    may work, and ``code`` is the service's error code as it sent it (None when it sent none)."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None,
                 code: str | None = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code


def encode(body: BaseModel | Mapping[str, Any] | None) -> bytes:
    """A request body on the wire: a wire model's JSON, a plain mapping's JSON, or ``{}``."""
    if isinstance(body, BaseModel):
        return body.model_dump_json().encode()
    return json.dumps(dict(body or {})).encode()


class ServiceClient:
    """Requests to one service (``name``, as its errors call it) on a NATS connection."""

    def __init__(self, nc: NATS, name: str, timeout_s: float):
        self.nc = nc
        self.name = name
        self.timeout_s = timeout_s

    async def request(self, subject: str, body: BaseModel | Mapping[str, Any] | None = None,
                      timeout_s: float | None = None) -> bytes:
        """The answer's bytes; ServiceError for a refusal or no answer."""
        timeout_s = timeout_s or self.timeout_s
        try:
            msg = await self.nc.request(subject, encode(body), timeout=timeout_s)
        except NoRespondersError as exc:
            raise ServiceError(503, f"the {self.name} is not running (nobody answers {subject}); "
                                    f"retry later", retry_after_s=5) from exc
        except (TimeoutError, NatsTimeoutError) as exc:
            raise ServiceError(504, f"the {self.name} did not answer {subject} "
                                    f"within {timeout_s:g} s") from exc
        except Exception as exc:  # connection closed or reconnecting
            raise ServiceError(503, f"the message bus is unavailable ({type(exc).__name__}); retry",
                               retry_after_s=1) from exc
        headers = msg.headers or {}
        code = headers.get(ERROR_CODE_HEADER)
        if code:
            # A code that is no HTTP error status is the service misbehaving: a bad gateway.
            status = int(code) if code.isdigit() and 400 <= int(code) <= 599 else 502
            raise ServiceError(status, headers.get(ERROR_HEADER) or f"the {self.name} answered error {code}",
                               code=code)
        return msg.data

    async def call(self, subject: str, body: BaseModel | Mapping[str, Any] | None, reply: type[Reply],
                   timeout_s: float | None = None) -> Reply:
        """The answer as the wire type ``reply``; ServiceError (502) when it is not one."""
        data = await self.request(subject, body, timeout_s)
        try:
            return reply.model_validate_json(data)
        except ValidationError as exc:
            raise ServiceError(502, f"the {self.name}'s answer to {subject} is malformed: {exc}") from exc
