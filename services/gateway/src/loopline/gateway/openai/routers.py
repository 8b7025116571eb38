"""The OpenAI surface's routers, in the order the app includes them."""

from loopline.gateway.openai import api

ROUTERS = (api.router,)
