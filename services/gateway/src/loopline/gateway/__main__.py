"""``python -m loopline.gateway`` (and ``loopline-gateway``): the REST API under the shared runtime."""

from loopline.common import runtime
from loopline.common.settings import GatewaySettings
from loopline.gateway.service import run


def main() -> None:
    runtime.main("gateway", GatewaySettings, run)


if __name__ == "__main__":
    main()
