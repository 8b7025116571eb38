"""``python -m loopline.gateway`` (and ``loopline-gateway``): the REST API under the shared runtime."""

from loopline.common.config.settings import GatewaySettings
from loopline.common.runtime import service as runtime
from loopline.gateway.service import run


def main() -> None:
    runtime.main("gateway", GatewaySettings, run)


if __name__ == "__main__":
    main()
