"""Tenants: which jobs, adapters and Tinker objects a request may see. The one place that decides.

With API keys on, each key is a tenant named by the key's name (rotating a key keeps its name, so
its jobs stay its own). A key without ``admin`` sees only what it owns: what it submitted or
created records its name as ``owner``; anything else is answered exactly as if it did not exist
(the same 404, never a 403 that would confirm it exists, or its status). An ``admin`` key sees
everything, and so does every request when the gateway has no keys (one user, as before keys).

The trainer applies the same filter in SQL (``job_schemas.OwnerFilter``): ``latest`` and a hash
prefix resolve among the tenant's own jobs only.
"""

from __future__ import annotations

from fastapi import Request

from loopline.common.contracts.job_schemas import OwnerFilter
from loopline.gateway.auth.api_keys import api_key_of


def tenant_of(request: Request) -> OwnerFilter:
    """The owner whose things ``request`` may see: its key's name; None (everything) with no keys
    or an admin key."""
    key = api_key_of(request)
    if key is None or key.is_admin:
        return None
    return key.name


def owner_of(request: Request) -> str | None:
    """What a thing made by ``request`` records as its owner: the key's name, admin or not; None
    with no keys."""
    key = api_key_of(request)
    return None if key is None else key.name


def sees(tenant: OwnerFilter, owner: str | None) -> bool:
    """Whether a request of ``tenant`` (tenant_of) may see a thing owned by ``owner``."""
    return tenant is None or owner == tenant
