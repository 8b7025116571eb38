"""The Tinker surface (``/api/v1/*`` for the unmodified ``tinker`` SDK, and ``/v1/tinker/*`` events):
sessions, training calls and futures, sampling through the serving path, runs and checkpoints."""
