"""The dashboard's pages: the overview, a training job, a Tinker training run, and the job's
cancel / restart / delete forms. Each page is whole HTML that works without JavaScript; with it,
``live.js`` follows ``/ui/live`` (live_api.py) and replaces the sections that change.

Scopes are the API's: the overview needs any key (it shows jobs and runs with the training scope,
the queue with admin), a job or run page the training scope and the viewer's own job or run; cancel
and restart the training scope, delete admin, as ``/v1/megatron/cancel|restart|delete``.
"""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from loopline.common.contracts import subjects
from loopline.gateway.auth.scopes import ADMIN, ANY_KEY, TRAINING
from loopline.gateway.core.errors import ApiError
from loopline.gateway.core.route_spec import TRAINER, declare
from loopline.gateway.gateway import gateway_of
from loopline.gateway.scalarlm.statuses import JOB
from loopline.gateway.ui.pages import JobPage, Overview, RunPage, render
from loopline.gateway.ui.views import Viewer

router = APIRouter(prefix="/ui")

HTML = "text/html"
# The pages are the gateway's own: no frame of another site may hold them (clickjacking a cancel
# button), and they run only their own script and style.
PAGE_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
ACTIONS = {"cancel": (TRAINING, subjects.SVC_TRAINER_CANCEL),
           "restart": (TRAINING, subjects.SVC_TRAINER_RESTART),
           "delete": (ADMIN, subjects.SVC_TRAINER_DELETE)}
# What a job page may say as its own alert, by the code its form's redirect carries: the gateway's
# words only. Free text from the URL would let any link put a line of the attacker's on the page
# ("your key expired, paste it at ..."), escaped or not.
NOTICES = {
    "cancel-done": "cancel: done",
    "cancel-refused": "cancel refused: the job's status does not allow it (see its status above)",
    "restart-done": "restart: done",
    "restart-refused": "restart refused: the job's status does not allow it (see its status above)",
}


def page(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=PAGE_HEADERS)


def live_url(kind: str, ident: str = "") -> str:
    return f"/ui/live?page={kind}" + (f"&id={quote(ident, safe='')}" if ident else "")


@router.get("", **declare(ANY_KEY, media_type=HTML))
async def overview(request: Request) -> Response:
    viewer = Viewer.of(request)
    state = Overview(gateway_of(request), viewer)
    return page(render("overview.html", title="Overview", viewer=viewer, sections=await state.sections(),
                       live=live_url("overview")))


@router.get("/jobs/{job}", **declare(TRAINING, {**JOB, **TRAINER}, media_type=HTML))
async def job_page(request: Request, job: str, notice: str | None = None) -> Response:
    viewer = Viewer.of(request)
    gateway = gateway_of(request)
    info = await gateway.trainer.get(job, viewer.tenant)
    state = JobPage(gateway, viewer, info)
    sections = await state.sections()
    actions = [name for name, (need, _) in ACTIONS.items() if viewer.can(need)]
    return page(render("job.html", title=f"Job {info.job_hash[:12]}", viewer=viewer, job=state.job,
                       sections=sections, params=state.params(), actions=actions,
                       message=NOTICES.get(notice or ""),
                       live=live_url("job", info.job_hash)))


@router.get("/runs/{run_id}", **declare(TRAINING, {404: "no such training run"}, media_type=HTML))
async def run_page(request: Request, run_id: str) -> Response:
    viewer = Viewer.of(request)
    gateway = gateway_of(request)
    model = await gateway.tinker.model(run_id, viewer.tenant)
    state = RunPage(gateway, viewer, model)
    try:
        sections = await state.sections()
    finally:
        await state.close()
    return page(render("run.html", title=f"Run {model.model_id}", viewer=viewer, model=model,
                       sections=sections, live=live_url("run", model.model_id)))


async def _act(request: Request, job: str, action: str) -> Response:
    """Do ``action`` to the viewer's own job (any job with admin); back to its page, which says
    what happened (a 409, such as restarting a running job, is said there, not thrown)."""
    viewer = Viewer.of(request)
    trainer = gateway_of(request).trainer
    info = await trainer.get(job, viewer.tenant)  # another key's job: 404, as the API
    try:
        await trainer.control(ACTIONS[action][1], info.job_hash)
        outcome = "done"
    except ApiError as exc:
        if exc.status >= 500 or exc.status == 404:
            raise
        outcome = "refused"
    if action == "delete":
        return RedirectResponse("/ui", status_code=303)
    return RedirectResponse(f"/ui/jobs/{info.job_hash}?notice={action}-{outcome}", status_code=303)


_ACTION_STATUSES = {**JOB, **TRAINER, 303: "done or refused: back to the job's page, which says which"}


@router.post("/jobs/{job}/cancel", **declare(TRAINING, _ACTION_STATUSES, media_type=HTML))
async def cancel(request: Request, job: str) -> Response:
    return await _act(request, job, "cancel")


@router.post("/jobs/{job}/restart", **declare(TRAINING, _ACTION_STATUSES, media_type=HTML))
async def restart(request: Request, job: str) -> Response:
    return await _act(request, job, "restart")


@router.post("/jobs/{job}/delete", **declare(ADMIN, _ACTION_STATUSES, media_type=HTML))
async def delete(request: Request, job: str) -> Response:
    return await _act(request, job, "delete")
