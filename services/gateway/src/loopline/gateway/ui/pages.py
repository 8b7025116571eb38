"""The dashboard's pages as state that renders its sections: a page request renders them once; a
live stream (live_api.py) keeps the same state and renders them again at each event or refresh.

Templates are Jinja2's, autoescaped: every value a client or job wrote (a job's error, a run's
metadata, a metric's name) is text on the page, never markup.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from loopline.common.contracts.job_schemas import JobInfo
from loopline.common.contracts.tinker_schemas import TinkerModel
from loopline.gateway.core.errors import ApiError
from loopline.gateway.gateway import Gateway
from loopline.gateway.ui import views
from loopline.gateway.ui.charts import svg
from loopline.gateway.ui.listings import Listing
from loopline.gateway.ui.views import LogTail, RunHistory, Viewer, Visibility

TEMPLATES = Environment(loader=PackageLoader("loopline.gateway.ui", "templates"),
                        autoescape=select_autoescape(default=True, default_for_string=True))


def render(template: str, **context: Any) -> Markup:
    """The template rendered: markup, which a page template puts in as it is (its values were
    escaped as it was rendered)."""
    return Markup(TEMPLATES.get_template(template).render(**context))


class Page(Protocol):
    async def sections(self, listing: Listing | None = None) -> dict[str, Markup]:
        """Every section rendered; from ``listing`` where given (a live page's, shared by all of
        the gateway's), else from a listing made now."""
        ...

    async def close(self) -> None: ...


class Overview:
    def __init__(self, gateway: Gateway, viewer: Viewer):
        self.gateway = gateway
        self.viewer = viewer
        self.visibility = Visibility(gateway, viewer)

    async def sections(self, listing: Listing | None = None) -> dict[str, Markup]:
        ui = self.gateway.ui
        listing = listing or await ui.listings.fresh()
        cluster = await ui.cluster.snapshot()
        jobs = views.jobs_section(self.gateway, self.viewer, listing)
        visible = None if self.viewer.tenant is None else jobs.get("hashes", set())
        events = await views.recent_events(list(ui.events.events), self.visibility)
        return {
            "cluster": render("sections/cluster.html",
                              **views.cluster_section(cluster, self.viewer, visible)),
            "serving": render("sections/serving.html", **views.serving_section(cluster, self.viewer)),
            "jobs": render("sections/jobs.html", **jobs),
            "runs": render("sections/runs.html", **views.runs_section(self.viewer, listing)),
            "events": render("sections/events.html", events=events),
        }

    async def close(self) -> None:
        return None


class JobPage:
    def __init__(self, gateway: Gateway, viewer: Viewer, job: JobInfo):
        self.gateway = gateway
        self.viewer = viewer
        self.job = job
        self.log = LogTail(job.job_hash, viewer.tenant)

    async def sections(self, listing: Listing | None = None) -> dict[str, Markup]:
        try:
            self.job = await self.gateway.trainer.get(self.job.job_hash, self.viewer.tenant)
        except ApiError as exc:
            if exc.status == 404:  # deleted while the page was open
                return {"job-status": render("sections/log.html", error="This job no longer exists.")}
        cluster = await self.gateway.ui.cluster.snapshot()
        status = views.job_status(self.gateway, self.job, cluster)
        status["learning_rate"] = self._learning_rate()
        log_error = None
        try:
            await self.log.read(self.gateway)
        except ApiError as exc:
            log_error = f"cannot read the log: {exc.message}"
        loss = views.job_loss(self.job)
        return {
            "job-status": render("sections/job_status.html", **status),
            "job-loss": render("sections/chart.html", chart=svg(loss, title="training loss"),
                               caption=f"loss per step, {len(self.job.history)} steps logged"),
            "job-log": render("sections/log.html", lines=list(self.log.lines), error=log_error),
        }

    def _learning_rate(self) -> float | None:
        for event in reversed(self.gateway.ui.events.events):
            if event.job_hash == self.job.job_hash and event.body.get("learning_rate") is not None:
                return float(event.body["learning_rate"])
        return None

    def params(self) -> str:
        params = self.job.params.model_dump(exclude_none=True)
        return json.dumps(params, indent=2, sort_keys=True, default=str)

    async def close(self) -> None:
        return None


class RunPage:
    def __init__(self, gateway: Gateway, viewer: Viewer, model: TinkerModel):
        self.gateway = gateway
        self.viewer = viewer
        self.model = model
        self.history = RunHistory(model)

    async def sections(self, listing: Listing | None = None) -> dict[str, Markup]:
        store = self.gateway.tinker.store
        self.model = await store.model(self.model.model_id) or self.model
        await self.history.catch_up(self.gateway.js)
        cluster = await self.gateway.ui.cluster.snapshot()
        checkpoints = await store.checkpoints(self.model.model_id)
        status = views.run_status(self.model, checkpoints, cluster, self.history)
        loss = self.history.loss
        charts = [{"name": name, "chart": svg(curve, title=name)}
                  for name, curve in sorted(self.history.metrics.items())]
        for curve in (self.history.learning_rate, self.history.staleness):
            if curve.points:
                charts.append({"name": curve.name, "chart": svg(curve, title=curve.name)})
        return {
            "run-status": render("sections/run_status.html", **status),
            "run-loss": render("sections/chart.html", chart=svg(loss, title="loss"),
                               caption=f"the sum of each optimizer step's forward_backward losses, "
                                       f"{self.history.steps} steps"),
            "run-metrics": render("sections/run_metrics.html", charts=charts, run_id=self.model.model_id),
        }

    async def close(self) -> None:
        await self.history.close()
