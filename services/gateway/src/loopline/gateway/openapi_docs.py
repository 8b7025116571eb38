"""What the gateway's OpenAPI document says about the routes it relays to vLLM.

Their bodies are vLLM's request schemas, validated by vLLM in the replica; the gateway's own
answers add the statuses of the queue (admission, durability, time-outs) to vLLM's.
"""

from __future__ import annotations

from typing import Any

_ERROR = {"description": "OpenAI's error shape: `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`"}
# Every status a relayed route can answer, and who answers it.
STATUSES: dict[int, str] = {
    200: "vLLM's answer (JSON, or `text/event-stream` when `stream` is true)",
    400: "vLLM refused the request (its validation), or the body is not a JSON object",
    401: "an API key is configured and the request has none or a wrong one",
    404: "no such model, job or adapter, or a route the deployment's vLLM does not serve",
    413: "the body is larger than `LOOPLINE_MAX_BODY_BYTES`",
    422: "the adapter of the job cannot be served by this deployment (the message says why)",
    429: "the deployment's queue is full (admission): retry after `Retry-After`",
    503: "the message bus or the queue is unavailable: retry after `Retry-After`",
    504: "no inference replica answered in time; the request stays queued",
}


def route_docs(path: str) -> dict[str, Any]:
    """The keyword arguments of ``APIRouter.add_api_route`` that document ``path``."""
    responses: dict[int | str, dict[str, Any]] = {
        status: ({"description": text} if status == 200 else {**_ERROR, "description": text})
        for status, text in STATUSES.items()
    }
    return {"summary": f"vLLM's {path}, through the queue", "responses": responses,
            "name": "relay" + path.replace("/", "_")}
