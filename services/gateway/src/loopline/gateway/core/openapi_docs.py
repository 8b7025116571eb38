"""The gateway's OpenAPI document: every route's request body and every status it can answer.

vLLM's relayed routes (QUEUED_ROUTES) take vLLM's own request schemas, validated by vLLM in the
replica. The gateway does not import vLLM (its image has none), so they come from
``vllm_openapi.json`` beside this module, written from the app ``vllm serve`` builds by

    python -m loopline.gateway.core.openapi_docs --write

(tests/gateway/test_openapi.py fails when the file is not what the installed vLLM writes). The
gateway's own answers add the queue's statuses (admission, durability, time-outs) to vLLM's. Every
other route declares its statuses and scope where it is defined (route_spec.declare): ``install``
gives them the error shape they are answered in, and adds the middleware's 401, 403, 413 and 429
(403 on every method that can change state: a browser page of another origin, auth/same_origin.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from loopline.common.contracts.schemas import QUEUED_ROUTES
from loopline.gateway.auth.same_origin import SAFE_METHODS
from loopline.gateway.auth.scopes import INFERENCE, OPEN, SCOPES
from loopline.gateway.core.errors import is_openai_path
from loopline.gateway.core.route_spec import GATEWAY_ERROR, SCOPE

VLLM_OPENAPI = Path(__file__).with_name("vllm_openapi.json")
OPENAI_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}  # vLLM's, in vllm_openapi.json
DETAIL_ERROR = {"$ref": "#/components/schemas/GatewayError"}

# Every status a relayed route can answer, and who answers it; vLLM's statuses the gateway relays
# that are not here (501 where vLLM documents it) come from its document.
STATUSES: dict[int, str] = {
    200: "vLLM's answer (JSON, or `text/event-stream` when `stream` is true)",
    400: "vLLM refused the request (its validation), or the body is not a JSON object, or it asks "
         "for more samples (`n`, `best_of`) than `LOOPLINE_MAX_SAMPLES_PER_REQUEST`",
    404: "no such model, job or adapter, or a route the deployment's vLLM does not serve",
    410: "the request was cleared from the queue (`/v1/generate/clear_queue`) before it was served",
    413: "the body is larger than `LOOPLINE_MAX_BODY_BYTES`, or vLLM's answer is too large to travel "
         "through the queue (the message says which)",
    422: "the adapter of the job cannot be served by this deployment (the message says why)",
    429: "the deployment's queue is full (admission): retry after `Retry-After`",
    503: "the message bus is unavailable (retry after `Retry-After`), no replica has served the "
         "model for `LOOPLINE_REPLICA_GRACE_S` (the same), or no replica completed the request after "
         "several deliveries",
    504: "no inference replica answered in time; the request stays queued",
}
# vLLM documents these, but the gateway promises neither: vLLM answers a body that fails validation
# with 400 (its handler), and a 500 is a fault the fuzz run (tests/e2e/test_fuzz.py) looks for.
NOT_RELAYED = {"422", "500"}
MIDDLEWARE_STATUSES = {
    401: "API keys are on (`LOOPLINE_API_KEYS`, `LOOPLINE_API_KEYS_FILE`) and the request has none "
         "or a wrong one",
    403: "the API key lacks the scope this route needs (the message names it; `x-loopline-scope`)",
    429: "the API key is over its request rate or its queue share at this gateway: retry after "
         "`Retry-After`",
    413: "the body is larger than the limit (`LOOPLINE_MAX_BODY_BYTES`, or the upload limit)",
}
# What SameOrigin (auth/same_origin.py) answers on every method that can change state, and on a
# loopback gateway on every method.
CROSS_SITE_403 = ("a browser page of another origin sent the request (`Origin`, `Sec-Fetch-Site`; "
                  "the message says which): trusted origins are listed in `LOOPLINE_ALLOWED_ORIGINS`")
REBOUND_403 = ("the request named this gateway, which listens on a loopback address, by a name that is "
               "not this machine's (`Host`; DNS rebinding): ask it as localhost or 127.0.0.1")


@cache
def vllm_document() -> dict[str, Any]:
    """vLLM's request bodies and responses of the relayed routes, and the schemas they refer to."""
    return json.loads(VLLM_OPENAPI.read_text())


def route_docs(path: str) -> dict[str, Any]:
    """The keyword arguments of ``APIRouter.add_api_route`` that document ``path``."""
    vllm = vllm_document()["paths"][path]
    responses: dict[int | str, dict[str, Any]] = {
        status: {"description": text, "content": {"application/json": {"schema": OPENAI_ERROR}}}
        for status, text in STATUSES.items()
    }
    responses[200] = {"description": STATUSES[200], "content": vllm["responses"]["200"]["content"]}
    for status, answer in vllm["responses"].items():
        if int(status) not in responses and status not in NOT_RELAYED:
            responses[int(status)] = {**answer, "description": f"vLLM: {answer['description']}"}
    return {"summary": f"vLLM's {path}, through the queue", "responses": responses,
            "name": "relay" + path.replace("/", "_"),
            "openapi_extra": {SCOPE: INFERENCE, "requestBody": vllm["requestBody"]}}


def install(app: FastAPI, *, api_keys: bool, loopback: bool = False) -> None:
    """Make ``app.openapi()`` the complete document: vLLM's schemas merged in, each route's
    declared statuses in their error shape, and what the middleware answers (``api_keys``: whether
    401 can be; ``loopback``: whether the gateway listens on a loopback address, where a browser's
    read can be refused too)."""
    build: Callable[[], dict[str, Any]] = app.openapi  # FastAPI's own; it caches in openapi_schema

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            complete(build(), api_keys=api_keys, loopback=loopback)
        return app.openapi_schema  # type: ignore[return-value]  # build() set it

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise it


def complete(doc: dict[str, Any], *, api_keys: bool, loopback: bool = False) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in {**vllm_document()["components"]["schemas"], "GatewayError": GATEWAY_ERROR}.items():
        if schemas.setdefault(name, schema) != schema:
            raise RuntimeError(f"the schema {name!r} is both the gateway's and vLLM's: rename the gateway's")
    for path, operations in doc["paths"].items():
        error = OPENAI_ERROR if is_openai_path(path) else DETAIL_ERROR
        for method, operation in operations.items():
            responses = operation["responses"]
            if path not in QUEUED_ROUTES:
                # FastAPI's default 422 (its HTTPValidationError) is not what errors.py answers; a
                # route that answers 422 declares it.
                if "HTTPValidationError" in json.dumps(responses.get("422", {})):
                    responses.pop("422")
                for status, answer in responses.items():
                    if status != "200":  # declared with a description only: FastAPI's schema is {}
                        answer["content"] = {"application/json": {"schema": error}}
                ok = responses["200"].get("content", {})
                if len(ok) > 1:  # a declared media type beside FastAPI's default JSON
                    ok.pop("application/json", None)
            statuses = {413: MIDDLEWARE_STATUSES[413]}
            scope = operation.get(SCOPE)
            if api_keys and scope != OPEN:
                # A route's own 403 or 429 (ownership, a full queue) is documented as the route's.
                keyed = {401, 429, *([403] if scope in SCOPES else [])}
                statuses |= {s: MIDDLEWARE_STATUSES[s] for s in keyed}
            for status, text in statuses.items():
                responses.setdefault(str(status), {"description": text,
                                                   "content": {"application/json": {"schema": error}}})
            browser = [*([] if method.upper() in SAFE_METHODS else [CROSS_SITE_403]),
                       *([REBOUND_403] if loopback else [])]
            if browser:
                # Beside a route's own or the key's 403, every cause is listed.
                refused = responses.setdefault("403", {"description": "",
                                                       "content": {"application/json": {"schema": error}}})
                refused["description"] = "; or ".join(filter(None, [refused["description"], *browser]))


# --- vllm_openapi.json, from vLLM itself (needs vLLM installed) -------------------------------------
def generate() -> dict[str, Any]:
    """What vLLM's app documents for the relayed routes: built as ``vllm serve`` builds it, without an
    engine, for a generation model; the pooling routes are mounted as vLLM mounts them for a model
    that serves every pooling task (its own routers: without a model config build_app adds none)."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.pooling.classify.api_router import router as classify
    from vllm.entrypoints.pooling.embed.api_router import router as embed
    from vllm.entrypoints.pooling.pooling.api_router import router as pooling
    from vllm.entrypoints.pooling.scoring.api_router import router as scoring
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.version import __version__

    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    app = build_app(args, ("generate",), model_config=None)
    for router in (pooling, classify, embed, scoring):
        # One app for all: FastAPI names a schema shared by two routes once, the same for both.
        app.include_router(router)
    full = app.openapi()
    paths = {path: {key: full["paths"][path]["post"][key] for key in ("requestBody", "responses")}
             for path in QUEUED_ROUTES}
    names = _referenced(full["components"]["schemas"], [paths, OPENAI_ERROR])
    return {"vllm": __version__, "paths": paths,
            "components": {"schemas": {name: full["components"]["schemas"][name] for name in sorted(names)}}}


def _referenced(schemas: dict[str, Any], roots: Iterable[Any]) -> set[str]:
    """The schemas ``roots`` refer to, directly or through one another."""
    found: set[str] = set()
    todo = list(roots)
    # Invariant: every schema named in found has had its own references put on todo.
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                name = ref.rpartition("/")[2]
                if name not in found:
                    found.add(name)
                    todo.append(schemas[name])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return found


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loopline.gateway.core.openapi_docs", description=(
        f"Check (or write) {VLLM_OPENAPI.name} against what the installed vLLM documents."))
    parser.add_argument("--write", action="store_true", help=f"write {VLLM_OPENAPI}")
    args = parser.parse_args(argv)
    text = render(generate())
    if args.write:
        VLLM_OPENAPI.write_text(text)
        print(f"wrote {VLLM_OPENAPI}")
        return 0
    current = VLLM_OPENAPI.read_text() if VLLM_OPENAPI.exists() else ""
    print(f"{VLLM_OPENAPI.name} is {'current' if current == text else 'out of date: run with --write'}")
    return 0 if current == text else 1


if __name__ == "__main__":
    sys.exit(main())
