"""What a gateway route declares where it is defined: the API-key scope it needs and the statuses it
answers besides 200, with why. ``@router.post(path, **declare(scope, statuses))`` keeps both on the
route itself, so adding a route is one edit: the OpenAPI document (openapi_docs.install) lists the
statuses and shows the scope as ``x-loopline-scope``, and the key check (auth/api_keys.py) reads
the scope off the app's routes. tests/gateway/test_openapi.py checks that every route declares
one, and the fuzz run (tests/e2e/test_fuzz.py) that no route answers a status it does not list.

401, 403, 413 and the keys' 429 are the middleware's (auth/api_keys.py, body_limit.py) and are
added to every route by openapi_docs; vLLM's relayed routes are documented by openapi_docs.route_docs.
The phrases below are the ones several surfaces share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SCOPE = "x-loopline-scope"  # the operation's key in openapi_extra, and so in the document

# How the non-OpenAI routes answer an error (errors.py): FastAPI's and ScalarLM's shape.
GATEWAY_ERROR = {"type": "object", "title": "GatewayError", "required": ["detail"],
                 "properties": {"detail": {"type": "string", "title": "Detail"}}}

NOT_JSON = "the body is not valid JSON"
FIELDS = "a field, query parameter or header is missing or of the wrong type (the message names it)"
MODEL = "no such model, or a job that is not deployed (the message says which and why)"
FULL = "the deployment's queue is full (admission): retry after `Retry-After`"
BUS = ("the message bus did not take the request, or no replica has served the model for "
       "`LOOPLINE_REPLICA_GRACE_S`: retry after `Retry-After`")
NO_BUS = "the message bus is unavailable: retry"
PAGE = "a negative `limit` or `offset`, or a `limit` above `LOOPLINE_MAX_LIST_LIMIT`"
STREAMS = ("this key (or client address, without keys) holds `LOOPLINE_MAX_STREAMS_PER_KEY` open "
           "streams already; or the key is over its request rate or queue share: retry after `Retry-After`")
TRAINER = {
    502: "the trainer answered with something that is not its API",
    503: "no trainer is running, or it cannot reach Slurm or the datasets store: retry",
    504: "the trainer did not answer in time",
}
QUEUE = {
    502: "the queue service answered with something that is not its API",
    503: "no queue service is running, or the message bus is unavailable: retry after `Retry-After`",
    504: "the queue service did not answer in time",
}
EVENT_STREAM = "text/event-stream"


def declare(scope: str, statuses: Mapping[int, str] | None = None, *, media_type: str | None = None,
            body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments of ``router.get``/``router.post``/``add_api_route`` for a route that
    needs ``scope`` (auth/scopes.py) and answers ``statuses`` besides 200; ``media_type`` when its
    200 is not one JSON body (a stream of lines, Prometheus text); ``body`` for a request body the
    route reads itself (so FastAPI cannot describe it), as OpenAPI's ``requestBody``/``parameters``."""
    responses: dict[int | str, dict[str, Any]] = {
        status: {"description": why} for status, why in (statuses or {}).items()}
    if media_type is not None:
        responses[200] = {"content": {media_type: {"schema": {"type": "string"}}}}
    return {"responses": responses, "openapi_extra": {SCOPE: scope, **(body or {})}}


def scope_of(route: Any) -> str | None:
    """What a route of the app declared with ``declare``; None for one that declared nothing
    (FastAPI's own pages)."""
    extra = getattr(route, "openapi_extra", None) or {}
    return extra.get(SCOPE)
