"""Pushing one COMPLETED job to the Hugging Face Hub with huggingface_hub's HfApi: the repo created
when missing (``create_repo``), the branch when missing (``create_branch``), then one commit
(``create_commit``, what ``upload_folder`` makes, here from files opened without following links:
hub_folder.py) of the checkpoint's folder, its model card and its loss plot.

The token is the trainer's (its settings' token file, else huggingface_hub's own lookup: HF_TOKEN,
then its saved login); the job never sees it, and it never appears in what is recorded. Blocking:
the hub loop calls ``push`` through a thread.

The token is the operator's, so the operator's settings say what a job may do with it, not the key
that asked: a namespace (LOOPLINE_HUB_ALLOWED_NAMESPACES, or an admin key) and a public repo
(LOOPLINE_HUB_ALLOW_PUBLIC) are checked at submission (``check_allowed``, a 422); an existing repo
this trainer did not create for the job's key (hub_repos.py; LOOPLINE_HUB_ALLOW_EXISTING_REPOS) is
only known at the push, which then fails saying why, before any file is sent.
"""

from __future__ import annotations

import contextlib
import logging

from huggingface_hub import CommitOperationAdd, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts.hub_push import MAX_ERROR_CHARS, HubPush, HubPushParams
from loopline.trainer import hub_card, hub_folder, info
from loopline.trainer.hub_repos import HubRepos
from loopline.trainer.registry import Job

log = logging.getLogger(__name__)


class NoToken(Exception):
    pass


class NotAllowed(Exception):
    """A push the operator's settings do not let this job make with the operator's token."""


def check_allowed(settings: TrainerSettings, request: HubPushParams, admin: bool) -> None:
    """Refuse, before any training, a push to a namespace the operator did not open to training
    keys (an ``admin`` key may push to any), or a public repo the operator did not allow."""
    namespace = request.repo_id.split("/", 1)[0]
    # The Hub's names are case-insensitive (its URLs redirect), so the list is too.
    allowed = {n.casefold() for n in settings.hub_namespace_set}
    if not admin and namespace.casefold() not in allowed:
        listed = ", ".join(sorted(settings.hub_namespace_set)) or "none"
        raise NotAllowed(f"repo_id: pushing to {namespace!r} needs an admin key, or {namespace!r} in "
                         f"the trainer's LOOPLINE_HUB_ALLOWED_NAMESPACES (now: {listed})")
    _check_visibility(settings, request)


def _check_visibility(settings: TrainerSettings, request: HubPushParams) -> None:
    if not request.private and not settings.hub_allow_public:
        raise NotAllowed("private: a public repo (private: false) needs LOOPLINE_HUB_ALLOW_PUBLIC=true "
                         "on the trainer")


def hub_token(settings: TrainerSettings) -> str | None:
    """The token jobs are pushed with: the token file's content, else huggingface_hub's own
    lookup (HF_TOKEN, the saved login); None when there is none. An unreadable token file raises
    NoToken: a Secret that was meant to be mounted is not silently replaced by another token."""
    if settings.hub_token_file is not None:
        try:
            token = settings.hub_token_file.read_text().strip()
        except OSError as exc:
            raise NoToken(f"the Hub token file LOOPLINE_HUB_TOKEN_FILE={settings.hub_token_file} cannot "
                          f"be read: {exc.strerror}") from exc
        return token or None
    return get_token()


class HubPusher:
    def __init__(self, settings: TrainerSettings, repos: HubRepos):
        self.settings = settings
        self.repos = repos

    def push(self, job: Job) -> HubPush:
        """Push the job's newest checkpoint as its params ask; the outcome, pushed or failed, is
        returned, never raised: a failed push leaves the job COMPLETED."""
        request = job.params.push_to_hub
        assert request is not None, f"job {job.job_hash} asked for no push"
        try:
            url, commit = self._push(job, request)
        except Exception as exc:  # noqa: BLE001 - the Hub's refusal, the network, a broken checkpoint: all recorded
            log.warning("job %s: push to %s@%s failed: %s", job.job_hash, request.repo_id, request.revision,
                        exc)
            return HubPush(repo_id=request.repo_id, revision=request.revision, status="failed",
                           error=_error_text(exc))
        log.info("job %s: pushed to %s", job.job_hash, url)
        return HubPush(repo_id=request.repo_id, revision=request.revision, status="pushed", url=url,
                       commit=commit)

    def _push(self, job: Job, request: HubPushParams) -> tuple[str, str]:
        token = hub_token(self.settings)
        if token is None:
            raise NoToken("this trainer has no Hugging Face token (HF_TOKEN or LOOPLINE_HUB_TOKEN_FILE)")
        _check_visibility(self.settings, request)  # the operator may have withdrawn it since submission
        api = HfApi(endpoint=self.settings.hub_endpoint, token=token, library_name="loopline")
        step, checkpoint = hub_folder.newest_checkpoint(job)
        history = info.job_info(job).history
        with contextlib.ExitStack() as stack:
            files = hub_folder.checkpoint_files(job, checkpoint, stack)  # before the repo: fails early
            plot = hub_card.loss_plot(job, history)
            if plot is not None:
                files[hub_card.PLOT_FILE] = plot
            files[hub_card.CARD_FILE] = hub_card.card_text(job, request, history, step,
                                                           plotted=plot is not None).encode()
            self._claim_repo(api, job, request)
            if request.revision != "main":
                api.create_branch(request.repo_id, branch=request.revision, exist_ok=True)
            operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=c) for p, c in files.items()]
            commit = api.create_commit(
                request.repo_id, operations,
                commit_message=f"Loopline job {job.job_hash[:12]}: step {step}",
                commit_description=f"Checkpoint {checkpoint} of Loopline job {job.job_hash}.",
                revision=request.revision)
        return commit.commit_url, commit.oid

    def _claim_repo(self, api: HfApi, job: Job, request: HubPushParams) -> None:
        """Create the repo and record it as the job's key's; a repo that exists already is written
        only when this trainer created it for that key, or the operator allows any."""
        try:
            api.create_repo(request.repo_id, private=request.private)
        except HfHubHTTPError as exc:
            if exc.response is None or exc.response.status_code != 409:
                raise
            if not (self.settings.hub_allow_existing_repos
                    or self.repos.created_for(request.repo_id, job.owner)):
                raise NotAllowed(f"{request.repo_id} already exists on the Hub and was not created by "
                                 f"this trainer for this job's key: pushing to it needs "
                                 f"LOOPLINE_HUB_ALLOW_EXISTING_REPOS=true") from None
            return
        # After the Hub made it: a record of a repo someone else made first would hand it over.
        self.repos.record(request.repo_id, job.owner, job.job_hash)


def _error_text(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."
