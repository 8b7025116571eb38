"""Statuses the Tinker routes share (their declarations: core/route_spec.py). The 400s name the field;
the SDK fails fast on a 4xx other than 408/409/429 and retries those and 5xx."""

from __future__ import annotations

BODY = "the body is not the SDK's request (the message names the field), or not JSON"
MODEL = "no such training client (model_id)"
CALL = {400: BODY, 404: MODEL, 429: "the Tinker call queue is full: retry later",
        503: "the message bus did not take the call: retry"}
SESSION = {410: "no such session (the SDK stops its heartbeat)"}
MODELS_QUOTA = ("this key (all clients together, without keys) holds "
                "`LOOPLINE_MAX_TINKER_MODELS_PER_KEY` live training clients, until one idles out "
                "(`x-should-retry: false`)")
QUOTA = ("this key (or client address, without keys) created `LOOPLINE_MAX_TINKER_SESSIONS_PER_KEY` "
         "sessions and sampling sessions within `LOOPLINE_TINKER_SESSIONS_MAX_AGE_S` at this gateway: "
         "retry after `Retry-After`; or the key is over its request rate or queue share")
