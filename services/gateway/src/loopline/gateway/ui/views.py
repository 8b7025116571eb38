"""What each dashboard page shows, read for one viewer: the cluster for everyone with a key, the
queue's figures with the admin scope (as ``/v1/generate/metrics``), jobs and Tinker runs with the
training scope and only the viewer's own (auth/tenancy.py), as the API routes decide: from the
gateway's one listing of every tenant's (ui/listings.py), filtered here.

Each page is a set of *sections*, each rendered by its own template (templates/sections/): the
page renders them all; a live page's stream (ui/live_api.py) renders them again and sends the ones
that changed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from loopline.common.contracts import subjects
from loopline.common.contracts.job_schemas import JobInfo, LogsRequest, OwnerFilter
from loopline.common.contracts.tinker_schemas import SessionEvent, TinkerCheckpoint, TinkerModel
from loopline.gateway.auth.api_keys import api_key_of
from loopline.gateway.auth.scopes import ADMIN, SCOPES, TRAINING, allows
from loopline.gateway.auth.tenancy import sees, tenant_of
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.recent_requests import ANSWERS, RECENT
from loopline.gateway.gateway import Gateway
from loopline.gateway.scalarlm.train_streams_api import OwnJobs
from loopline.gateway.tinker.events_api import OwnRuns
from loopline.gateway.ui.charts import Curve
from loopline.gateway.ui.cluster_feed import Cluster
from loopline.gateway.ui.event_feed import FeedEvent
from loopline.gateway.ui.listings import Listing

EVENTS_SHOWN = 30
ANSWERS_SHOWN = 10
LOG_TAIL = 40
LOG_PAGE = 1000
# A run page reads its worker's events from EVENTS: the stored ones when it opens, then what came
# since at each update; at most this many in one pass (a long history is read over a few).
EVENTS_PER_PASS = 20_000
# Between the gateway that stamped a run's creation and the NATS server that stamps its events.
CLOCK_SKEW_S = 60.0


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the key's name and scopes (every scope when the gateway has no keys)."""

    name: str | None
    scopes: frozenset[str]
    tenant: OwnerFilter

    def can(self, need: str) -> bool:
        return allows(self.scopes, need)

    @classmethod
    def of(cls, request: Request) -> Viewer:
        key = api_key_of(request)
        if key is None:
            return cls(None, frozenset(SCOPES), None)
        return cls(key.name, key.scopes, tenant_of(request))


class Visibility:
    """Which events the viewer may see: its own jobs' and runs' (owners asked once each)."""

    def __init__(self, gateway: Gateway, viewer: Viewer):
        self.viewer = viewer
        self.jobs = OwnJobs(gateway.trainer, viewer.tenant) if viewer.tenant is not None else None
        self.runs = OwnRuns(gateway, viewer.tenant)

    async def sees(self, event: FeedEvent) -> bool:
        if not self.viewer.can(TRAINING):
            return False
        if self.jobs is None:
            return True
        if event.job_hash is not None:
            return await self.jobs.owns_job(event.job_hash)
        if event.area == "sessions":
            return await self.runs.sees_run(event.model_id)
        return False


# --- the overview ---------------------------------------------------------------------------------
async def recent_events(feed_events: list[FeedEvent], visibility: Visibility) -> list[dict[str, Any]]:
    shown: list[dict[str, Any]] = []
    for event in reversed(feed_events):
        if len(shown) >= EVENTS_SHOWN:
            break
        if await visibility.sees(event):
            shown.append(event_row(event))
    return shown


def event_row(event: FeedEvent) -> dict[str, Any]:
    body = event.body
    subject = event.job_hash or body.get("model_id") or body.get("worker_id") or ""
    detail = ", ".join(f"{k} {_short(body[k])}" for k in ("step", "loss", "status", "replica", "reason",
                                                         "error", "detail") if body.get(k) is not None)
    return {"seq": event.seq, "time": _clock(body.get("time")), "area": event.area, "kind": event.kind,
            "subject": subject, "detail": detail}


def jobs_section(gateway: Gateway, viewer: Viewer, listing: Listing) -> dict[str, Any]:
    if not viewer.can(TRAINING):
        return {"allowed": False}
    if listing.jobs_error is not None:
        return {"allowed": True, "error": listing.jobs_error, "jobs": []}
    jobs = [job for job in listing.jobs if sees(viewer.tenant, job.owner)]
    return {"allowed": True, "jobs": [job_row(gateway, job) for job in jobs[:50]], "total": len(jobs),
            "hashes": {job.job_hash for job in jobs}}


def job_row(gateway: Gateway, job: JobInfo) -> dict[str, Any]:
    return {"hash": job.job_hash, "status": job.status.value, "step": job.step, "max_steps": job.max_steps,
            "loss": job.history[-1].loss if job.history else None, "created": _clock(job.created_at),
            "deployed": gateway.adapters.deployed(job.job_hash), "model": job.llm_name,
            "rejected": gateway.adapters.deployment_error(job.job_hash)}


def runs_section(viewer: Viewer, listing: Listing) -> dict[str, Any]:
    if not viewer.can(TRAINING):
        return {"allowed": False}
    if listing.runs_error is not None:
        return {"allowed": True, "error": listing.runs_error, "runs": []}
    models = sorted((m for m in listing.runs if sees(viewer.tenant, m.owner)), key=lambda m: m.created_at,
                    reverse=True)
    return {"allowed": True, "runs": [{"id": m.model_id, "base": m.model_name, "state": m.state,
                                       "rank": m.lora.rank, "created": _clock(m.created_at),
                                       "last": _clock(m.last_request_at)} for m in models[:50]],
            "total": len(models)}


def cluster_section(cluster: Cluster, viewer: Viewer, visible_jobs: set[str] | None) -> dict[str, Any]:
    """Deployments and replicas; a replica's adapters are listed where the viewer may see the job
    (``visible_jobs``: None, every one)."""
    deployments = []
    for d in cluster.deployments:
        replicas = [{"replica": r.replica, "engine": r.engine, "in_flight": r.in_flight, "served": r.served,
                     "adapters": sorted((job, step) for job, step in r.adapters.items()
                                        if visible_jobs is None or job in visible_jobs)}
                    for r in d.replicas]
        deployments.append({"name": d.name, "model": d.model, "max_model_len": d.max_model_len,
                            "tasks": ", ".join(d.tasks), "replicas": replicas,
                            "unserved_for_s": d.unserved_for_s})
    return {"deployments": deployments}


def serving_section(cluster: Cluster, viewer: Viewer) -> dict[str, Any]:
    """The queue's figures (admin), this gateway's latency, and the newest answers the viewer's
    own requests got: which model, adapter version and replica served each."""
    answers = [{"time": _clock(a.at), "route": a.route, "model": a.model, "adapter": a.adapter,
                "step": a.adapter_step, "replica": a.replica, "status": a.status}
               for a in reversed(ANSWERS.answers) if sees(viewer.tenant, a.owner)][:ANSWERS_SHOWN]
    return {"queue_allowed": viewer.can(ADMIN), "queue": cluster.queue, "queue_error": cluster.queue_error,
            "latency": RECENT.percentiles(), "answers": answers}


# --- a training job -------------------------------------------------------------------------------
@dataclass
class LogTail:
    """A job's newest log lines, read forward from where the last read stopped."""

    job_hash: str
    owner: OwnerFilter
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL))
    next_line: int = 0

    async def read(self, gateway: Gateway) -> None:
        for _ in range(20):  # at most 20 pages a refresh: a huge log catches up over a few
            asked = LogsRequest(job=self.job_hash, owner=self.owner, starting_line_number=self.next_line,
                                limit=LOG_PAGE)
            page = await gateway.trainer.logs(asked)
            self.lines.extend(line.line for line in page.lines)
            if page.lines:
                self.next_line = page.lines[-1].line_number + 1
            if len(page.lines) < LOG_PAGE:
                return


def job_status(gateway: Gateway, job: JobInfo, cluster: Cluster) -> dict[str, Any]:
    serving = cluster.adapter_replicas.get(job.job_hash, {})
    checkpoints = [{"step": c.step, "created": _clock(c.created_at),
                    "replicas": sorted(r for r, step in serving.items() if step == c.step)}
                   for c in sorted(job.checkpoints, key=lambda c: c.step, reverse=True)]
    return {"job": job, "status": job.status.value, "deployed": gateway.adapters.deployed(job.job_hash),
            "rejected": gateway.adapters.deployment_error(job.job_hash), "checkpoints": checkpoints,
            "started": _clock(job.started_at), "finished": _clock(job.finished_at),
            "created": _clock(job.created_at)}


def job_loss(job: JobInfo) -> Curve:
    curve = Curve("loss")
    for point in job.history:
        curve.add(point.step, point.loss)
    return curve


# --- a Tinker training run ------------------------------------------------------------------------
@dataclass
class RunHistory:
    """A run's loss per optimizer step and the metrics its client posted, from its worker's events
    on EVENTS: read whole once, then what arrived since at each ``catch_up``."""

    model: TinkerModel
    loss: Curve = field(default_factory=lambda: Curve("loss"))
    metrics: dict[str, Curve] = field(default_factory=dict)
    staleness: Curve = field(default_factory=lambda: Curve("samples' mean staleness"))
    learning_rate: Curve = field(default_factory=lambda: Curve("learning rate"))
    steps: int = 0
    clock_skew_s: float = CLOCK_SKEW_S
    _sub: JetStreamContext.PushSubscription | None = None

    async def catch_up(self, js: JetStreamContext, wait_s: float = 0.3) -> None:
        if not self.model.worker_id:
            return
        if self._sub is None:
            self._sub = await self._follow(js, self.model.worker_id)
        for _ in range(EVENTS_PER_PASS):
            try:
                msg = await self._sub.next_msg(timeout=wait_s)
            except NatsTimeoutError:  # nothing more stored, nothing new
                return
            try:
                event = SessionEvent.model_validate_json(msg.data)
            except ValueError:
                continue
            if event.model_id == self.model.model_id:
                self.apply(event)
            if msg.metadata.num_pending == 0:
                wait_s = 0.05  # caught up: take what comes at once, then return

    async def _follow(self, js: JetStreamContext, worker_id: str) -> JetStreamContext.PushSubscription:
        """The worker's events from shortly before this run was created: a worker serves every
        key's runs of its base model, and its history before this run (another tenant's runs
        perhaps, as many events as they made) is none of this page's to read."""
        since = datetime.fromtimestamp(max(0.0, self.model.created_at - self.clock_skew_s), tz=UTC)
        try:
            return await js.subscribe(subjects.session_event(worker_id, "*"), stream=subjects.EVENTS_STREAM,
                                      ordered_consumer=True, config=ConsumerConfig(
                                          deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since))
        except Exception as exc:  # NATS down
            raise ApiError(503, f"cannot follow the run's events: {exc}; retry") from exc

    def apply(self, event: SessionEvent) -> None:
        if event.kind == "step" and event.step is not None:
            self.steps = max(self.steps, event.step)
            if event.loss is not None:
                self.loss.add(event.step, event.loss)
            if event.learning_rate is not None:
                self.learning_rate.add(event.step, event.learning_rate)
            if event.staleness:
                total = sum(event.staleness.values())
                self.staleness.add(event.step, sum(k * n for k, n in event.staleness.items()) / max(total, 1))
        elif event.kind == "metrics" and event.metrics:
            step = event.step if event.step is not None else self.steps
            for name, value in sorted(event.metrics.items()):
                curve = self.metrics.get(name)
                if curve is None and len(self.metrics) < MAX_CHARTS:  # the first names reported
                    curve = self.metrics[name] = Curve(name)
                if curve is not None:
                    curve.add(step, value)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass


MAX_CHARTS = 24  # metric curves one run page draws


def run_status(model: TinkerModel, checkpoints: list[TinkerCheckpoint], cluster: Cluster,
               history: RunHistory) -> dict[str, Any]:
    rows = []
    for c in sorted(checkpoints, key=lambda c: c.created_at, reverse=True):
        serving = cluster.adapter_replicas.get(c.adapter or "", {})
        rows.append({"kind": c.checkpoint_type, "name": c.name, "path": c.tinker_path, "step": c.step,
                     "created": _clock(c.created_at),
                     "replicas": sorted(serving) if c.checkpoint_type == "sampler" else []})
    return {"model": model, "checkpoints": rows, "steps": history.steps, "created": _clock(model.created_at),
            "last": _clock(model.last_request_at)}


def _clock(at: float | None) -> str:
    if not at:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."
