"""Loopline queue service: request ledger, admission control, dead letters, metrics."""
