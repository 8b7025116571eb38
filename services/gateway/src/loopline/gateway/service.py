"""The gateway process: connect, build the parts, report as ``loopline-gateway``, serve HTTP.

Loops, each its own task under the shared runtime (loopline.common.runtime.service):
  http     uvicorn: the OpenAI and ScalarLM routes, /metrics     (http_server.py, http_metrics.py)
  models   MODELS bucket -> the served models, every 2 s         (model_directory.py)
The rest of the gateway runs on NATS subscriptions (queue state, answers, adapter events), which
need no loop of their own. The gateway listens only once every part has started: a client that
reaches it can be routed.
"""

from __future__ import annotations

from loopline.common.config.settings import GatewaySettings
from loopline.common.contracts import subjects
from loopline.common.runtime.service import Runtime
from loopline.gateway.app import create_app
from loopline.gateway.core import http_metrics
from loopline.gateway.gateway import Gateway
from loopline.gateway.http_server import HttpServer


async def run(rt: Runtime, settings: GatewaySettings) -> None:
    # 1. Connect (and make sure every stream and bucket exists).
    nc, js = await rt.connect()

    # 2. Build the parts, subscribe and read the served models; unsubscribe at the stop.
    gateway = Gateway(nc, js, settings)
    await gateway.start()
    rt.on_stop(gateway.stop)

    # 3. Report as an instance of loopline-gateway ($SRV.PING, svc.gateway.status).
    await rt.add_service(
        subjects.GATEWAY_SERVICE, subjects.SVC_GATEWAY_STATUS, status=gateway.status_detail,
        description="Loopline gateway: OpenAI- and ScalarLM-compatible REST over NATS",
        metadata={"http": f"{settings.host}:{settings.port}", "answers": gateway.answers.gateway})

    # 4. Serve HTTP (every request counted for /metrics) and keep the model registry fresh until
    #    told to stop; in-flight requests finish before NATS drains.
    app = create_app(settings, gateway)
    http_metrics.install(app)
    server = HttpServer(app, settings)
    await rt.serve({
        "http": server.serve_until(rt.stopping),
        "models": gateway.models.run(rt.stopping),
    })
