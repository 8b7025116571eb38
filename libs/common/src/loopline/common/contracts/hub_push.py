"""Pushing a finished job to the Hugging Face Hub: what a job asks for (``HubPushParams``, its
``push_to_hub`` param) and where that stands (``HubPush``: JobInfo.hub and the job's ``hub`` event).

The trainer service pushes, after the job is COMPLETED, with its own token (never the job's: a
job's code never sees one); the training program only carries the request in its config.json.
Names are checked by huggingface_hub's own validator, so a name the Hub would refuse is a 422 at
submission rather than a failed push after training.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

# A branch to commit to: git's ref rules narrowed to one path component, so that the revision is
# one segment of the Hub's URLs (/api/models/<repo>/commit/<revision>) without quoting surprises.
_BRANCH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")
_COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
# The most of a push's error kept (the Hub's answers can quote whole request bodies).
MAX_ERROR_CHARS = 2000

HubPushStatus = Literal["pending", "pushed", "failed"]


class HubPushParams(BaseModel):
    """``push_to_hub``: push the job's final checkpoint to ``repo_id`` at ``revision`` when it
    completes, creating the repo (private or not) and the branch when missing."""

    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(description="namespace/name of a model repo on the Hub")
    # Only used when the repo is created: an existing repo keeps its visibility.
    private: StrictBool = True
    revision: str = "main"

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # As in every other param: `"revision": null` is "not given".
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("repo_id")
    @classmethod
    def _hub_repo_id(cls, value: str) -> str:
        from huggingface_hub.utils import validate_repo_id  # the Hub's own rule; imported when used

        validate_repo_id(value)  # raises HFValidationError, a ValueError
        if value.count("/") != 1:
            # Without a namespace the Hub picks the token's user: say whose repo it is instead.
            raise ValueError(f"give the repo as 'namespace/name' (a user or organisation), not {value!r}")
        return value

    @field_validator("revision")
    @classmethod
    def _branch_name(cls, value: str) -> str:
        if _COMMIT_HASH.match(value):
            raise ValueError("a push goes to a branch: name one, not a commit hash")
        if not _BRANCH.match(value) or ".." in value or value.endswith((".", ".lock")):
            raise ValueError(f"{value!r} is not a branch name: letters, digits, '.', '_' and '-', "
                             f"up to 100, no '..', not ending in '.' or '.lock'")
        return value


class HubPush(BaseModel):
    """Where a job's push stands: ``pending`` from COMPLETED until the trainer has tried, then
    ``pushed`` (``url`` and ``commit`` say where) or ``failed`` (``error`` says why; the job stays
    COMPLETED)."""

    repo_id: str
    revision: str
    status: HubPushStatus
    url: str | None = None  # the commit's page on the Hub
    commit: str | None = None
    error: str | None = Field(default=None, max_length=MAX_ERROR_CHARS)
