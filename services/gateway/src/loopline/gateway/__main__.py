"""``python -m loopline.gateway``: serve the REST API."""

import uvicorn

from loopline.common import process
from loopline.common.settings import GatewaySettings
from loopline.common.telemetry import setup_tracing
from loopline.gateway.app import create_app


def main() -> None:
    settings = GatewaySettings()
    process.setup_logging("gateway", settings.log_level)
    setup_tracing("loopline-gateway", settings.otlp_endpoint)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                timeout_keep_alive=settings.keep_alive_s, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
