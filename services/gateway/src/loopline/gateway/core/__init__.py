"""The gateway's core, shared by its surfaces: the model directory and adapters, admission, publishing
work, hearing answers and finding results, request ids, the trainer's and queue's request-reply
clients, error shapes, body limits, event streams, metrics and the OpenAPI document."""
