"""The ``loopline`` command-line tool: talks to the gateway over HTTP only."""
