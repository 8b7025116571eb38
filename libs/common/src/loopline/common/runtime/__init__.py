"""How a Loopline process lives on the bus: the shared service runtime, the NATS connection and
topology, request-reply clients, telemetry and metrics, NATS credentials and permissions per role,
and the shared NATS-backed operations (the Tinker records, retiring an adapter)."""
