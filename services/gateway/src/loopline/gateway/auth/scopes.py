"""The API-key scopes a route can need; each route declares its own where it is defined
(``**declare(scope, ...)``, core/route_spec.py), and tests/gateway/test_openapi.py checks that
every route of the app does.

A key holds some of ``inference``, ``training`` and ``admin``; ``admin`` holds the other two as well.
Two levels need no scope: ``open`` routes need no key at all (container health probes), ``any key``
routes need a valid key of any scope (the Tinker SDK's session housekeeping, which a sampling client
and a training client both do). Cancelling or restarting a job is ``training``; the route itself
then lets a key without ``admin`` act only on the jobs it submitted (scalarlm/train_api.py). vLLM's
relayed routes (the OpenAI API: completions, chat, embeddings, ...) are all inference.
"""

from __future__ import annotations

INFERENCE = "inference"
TRAINING = "training"
ADMIN = "admin"
SCOPES = (INFERENCE, TRAINING, ADMIN)  # what a key can be given
OPEN = "open"
ANY_KEY = "any key"


def allows(scopes: frozenset[str], need: str) -> bool:
    """Whether a key holding ``scopes`` may call a route that needs ``need``."""
    return need in (OPEN, ANY_KEY) or ADMIN in scopes or need in scopes
