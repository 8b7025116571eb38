"""Loopline shared library."""
