"""Loopline inference service: an engine fed from JetStream."""
