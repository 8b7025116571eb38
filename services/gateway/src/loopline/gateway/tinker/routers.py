"""The Tinker surface's routers, in the order the app includes them."""

from loopline.gateway.tinker import events_api, rest_api, run_metrics, sampling_api, training_api

ROUTERS = (training_api.router, sampling_api.router, rest_api.router, events_api.router, run_metrics.router)
