"""The Hub repos this trainer created for jobs' pushes (``hub_repos`` table): a push may go to a repo
it created for the same API key, and to no other existing repo unless the operator allows it
(LOOPLINE_HUB_ALLOW_EXISTING_REPOS). Without the record, the operator's token would write over any
model it can reach (its organisation's, another tenant's) at a training key's word.

Synchronous, like the registry: the pusher calls it from its thread.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from loopline.common.db.rows import HubRepoRow


class HubRepos:
    def __init__(self, engine: Engine):
        self.engine = engine

    def created_for(self, repo_id: str, owner: str | None) -> bool:
        """Whether this trainer created ``repo_id`` for a job of ``owner`` (an API key's name)."""
        with Session(self.engine) as s:
            row = s.get(HubRepoRow, repo_id)
            return row is not None and row.owner == owner

    def record(self, repo_id: str, owner: str | None, job_hash: str) -> None:
        """Remember that ``repo_id`` was created now for ``owner``'s job. A row already there is
        replaced: the repo was deleted on the Hub since, and the one there now is this job's."""
        with Session(self.engine) as s, s.begin():
            s.merge(HubRepoRow(repo_id=repo_id, owner=owner, job_hash=job_hash, created_at=time.time()))
