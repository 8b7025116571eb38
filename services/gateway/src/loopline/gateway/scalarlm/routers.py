"""The ScalarLM surface's routers, in the order the app includes them."""

from loopline.gateway.scalarlm import generate_api, health_api, train_api, train_streams_api, upload_api

# Streams first: /train/logs/{job} must win where it overlaps /train/{job}/events ("logs/events").
ROUTERS = (generate_api.router, health_api.router, train_streams_api.router, train_api.router,
           upload_api.router)
