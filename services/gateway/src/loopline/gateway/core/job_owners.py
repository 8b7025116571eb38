"""Who owns a job's adapter: the trainer's ``owner`` of the job, asked once per job hash.

Adapter events (``events.adapters.<hash>.loaded``) come from inference replicas and carry no owner;
the job does (the API key that submitted it). A job's owner never changes: with keys on, the owner
is part of the job hash (contracts/job_hash.py), so a hash always names one owner's job, and the
answer is kept. Whether a tenant may see it is tenancy.sees, as everywhere.
"""

from __future__ import annotations

import logging

from loopline.common.contracts.job_schemas import OwnerFilter
from loopline.gateway.auth.tenancy import sees
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.trainer_client import TrainerClient

log = logging.getLogger(__name__)

# How long a lookup may take: /v1/models and a request naming an adapter wait for it (once per job).
LOOKUP_TIMEOUT_S = 2.0


class JobOwners:
    def __init__(self, trainer: TrainerClient):
        self.trainer = trainer
        self.known: dict[str, str | None] = {}  # job hash -> its owner: one entry per real job

    async def visible(self, tenant: OwnerFilter, job_hash: str) -> bool:
        """Whether a request of ``tenant`` (tenancy.tenant_of) may see or use the job's adapter.
        When the trainer cannot say (down, slow), no: a tenant's view fails closed."""
        if tenant is None:
            return True
        if job_hash not in self.known:
            try:
                info = await self.trainer.get(job_hash, timeout_s=LOOKUP_TIMEOUT_S)
            except ApiError as exc:
                if exc.status != 404:
                    log.debug("owner of %s not known now: %s", job_hash, exc.message)
                return False  # no such job (not kept: any name could fill the table), or no answer
            self.known[job_hash] = info.owner
        return sees(tenant, self.known[job_hash])
