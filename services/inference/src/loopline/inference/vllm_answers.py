"""Reading and stamping vLLM's answers: the few fields the platform needs from a response body.

Bodies stay the bytes vLLM wrote; these functions read usage and errors out of them, and, for a
request served by an adapter version, put back the name the client asked for and the version in
``system_fingerprint``. They edit bytes rather than re-serialising: in JSON text a key such as
``"model":"`` can only be a real key (a quote inside a string value is escaped), and vLLM writes its
JSON compactly, so the match is exact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from loopline.common.contracts.schemas import ErrorInfo

_FINGERPRINT = re.compile(rb'"system_fingerprint":(?:null|"[^"\\]*")')
# Usage objects nest one level at most (prompt_tokens_details, input_tokens_details).
_USAGE = re.compile(rb'"usage":\{(?:[^{}]|\{[^{}]*\})*\}')


def with_model(body: bytes, model: str) -> bytes:
    """The request body with ``model`` set (the name vLLM knows the pinned version by). A body
    that is not a JSON object is left alone: vLLM answers it with its own 400."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict):
        return body
    obj["model"] = model
    # ASCII escapes: a lone surrogate the client sent (json.loads keeps it) survives the round trip.
    return json.dumps(obj).encode()


@dataclass(frozen=True)
class VersionStamp:
    """Rewrites one adapter request's answer: vLLM's name for the version -> the client's name,
    vLLM's build fingerprint -> the version served (``<job hash>@<step>``)."""

    served_as: str
    asked_for: str
    fingerprint: str

    def apply(self, data: bytes) -> bytes:
        data = data.replace(b'"model":%s' % json.dumps(self.served_as).encode(),
                            b'"model":%s' % json.dumps(self.asked_for).encode())
        return _FINGERPRINT.sub(b'"system_fingerprint":%s' % json.dumps(self.fingerprint).encode(), data)


def usage_of(raw: bytes, streamed: bool) -> tuple[int, int]:
    """(prompt, completion) tokens from an answer's ``usage``; for a stream, its last one (present
    when the client asked for usage). (0, 0) where the answer has none."""
    found = _USAGE.findall(raw)
    if not found:
        return 0, 0
    try:
        usage = json.loads(found[-1][len(b'"usage":'):])
    except ValueError:
        return 0, 0
    prompt = usage.get("prompt_tokens") or usage.get("input_tokens") or 0
    completion = usage.get("completion_tokens") or usage.get("output_tokens") or 0
    return int(prompt), int(completion)


def error_of(status: int, raw: bytes) -> ErrorInfo | None:
    """A failed answer's error as the platform records it: vLLM's OpenAI error shape, or
    FastAPI's ``{"detail": ...}`` (a route this deployment does not serve)."""
    if status < 400:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return ErrorInfo(status=status, message=raw.decode("utf-8", "replace")[:1000], type="server_error")
    error = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(error, dict):
        return ErrorInfo(status=status, message=str(error.get("message", "")),
                         type=str(error.get("type") or "invalid_request_error"), param=error.get("param"))
    detail = obj.get("detail") if isinstance(obj, dict) else obj
    return ErrorInfo(status=status, message=detail if isinstance(detail, str) else json.dumps(detail))
