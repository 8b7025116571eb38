"""Refuse oversized bodies with 413 before reading them, and stop reading one that lies about its
size. Uploads get their own, larger limit."""

from __future__ import annotations

import json

from loopline.gateway.core.errors import error_body

# Training archives and their chunks are uploads too (the chunk route applies its own, smaller cap).
UPLOAD_PATHS = ("/v1/generate/upload", "/v1/megatron/train", "/v1/megatron/upload/chunk")


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, *, max_bytes: int, max_upload_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_upload_bytes if scope["path"] in UPLOAD_PATHS else self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, send, limit)
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, send, limit)

    async def _refuse(self, scope, send, limit: int):
        message = f"the request body is larger than the limit of {limit} bytes"
        payload = json.dumps(error_body(scope["path"], 413, message)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
