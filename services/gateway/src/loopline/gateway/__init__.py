"""Loopline gateway: OpenAI- and ScalarLM-compatible REST over NATS."""
