"""The dashboard's routers, in the order the app includes them."""

from loopline.gateway.ui import live_api, login_api, pages_api

ROUTERS = (login_api.router, live_api.router, pages_api.router)
