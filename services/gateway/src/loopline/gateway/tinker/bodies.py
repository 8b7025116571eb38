"""Reading the Tinker routes' JSON bodies: as the SDK's own request types, or as a plain object;
anything else is a 400 that names what is wrong (never a 500)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from loopline.gateway.core.errors import ApiError

Body = TypeVar("Body", bound=BaseModel)


async def parse(request: Request, kind: type[Body]) -> Body:
    """The body as the SDK's own request type; a 400 that names the field otherwise."""
    raw = await request.body()
    try:
        return kind.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ApiError(400, f"{where}: {first.get('msg')}", param=where) from None


async def json_object(request: Request) -> dict[str, Any]:
    """A body read as a JSON object; a 400 otherwise."""
    try:
        raw = json.loads(await request.body() or b"{}")
    except ValueError:
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the body must be a JSON object")
    return raw
