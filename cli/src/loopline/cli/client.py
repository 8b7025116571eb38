"""The gateway's training and Tinker routes over HTTP: requests, server-sent-event parsing, and the
mapping of every failure to a ``CliError`` that says what happened and what to do next."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"

# Exit codes: 1 = the job (or the server) failed; 2 = the user's input or job name is wrong (as
# click does for usage errors); 3 = the gateway cannot be reached at all.
EXIT_FAILED = 1
EXIT_USER = 2
EXIT_UNREACHABLE = 3
RUNS_HINT = "see `loopline tinker runs` for the training runs there are"


class CliError(Exception):
    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.message, self.hint, self.exit_code = message, hint, exit_code


@dataclass(frozen=True)
class SseMessage:
    event: str
    data: str
    id: str = ""  # the message's own ``id:`` field (Loopline's: the event's EVENTS sequence)


def parse_sse(lines: Iterable[str]) -> Iterator[SseMessage]:
    """Messages of a text/event-stream, given its lines without line endings.

    A bare JSON line outside the SSE framing is taken as one message too: ScalarLM's log stream is
    newline-delimited JSON under an event-stream content type, and the same parser serves both.
    """
    event, ident, data = "", "", list[str]()
    # Invariant: event, data and ident hold the fields of the message not yet dispatched.
    for line in lines:
        if not line:
            if data:
                yield SseMessage(event or "message", "\n".join(data), ident)
            event, ident, data = "", "", []
            continue
        if line.startswith(":"):
            continue  # a comment: servers send these as keep-alives
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field == "id":
            ident = value
        elif field == "retry":
            pass
        elif line.lstrip().startswith(("{", "[")):
            yield SseMessage("message", line)
    if data:
        yield SseMessage(event or "message", "\n".join(data), ident)


def error_detail(response: httpx.Response) -> str:
    """The server's own words: FastAPI's ``detail``, OpenAI's ``error.message``, ScalarLM's ``error``."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        detail = body.get("detail")
        if isinstance(detail, list):  # a 422 from request validation: one entry per bad field
            return "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail
                             if isinstance(d, dict)) or json.dumps(detail)
        if detail is not None:
            return detail if isinstance(detail, str) else json.dumps(detail)
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return json.dumps(body)[:300]


@dataclass(frozen=True)
class Missing:
    """What a 404 means for a request that names a thing: the error to raise instead."""

    what: str  # "training run <id>"
    hint: str


class Gateway:
    def __init__(self, base_url: str = DEFAULT_URL, timeout: float = 30.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        # The key in both headers a keyed gateway reads: Bearer on /v1, X-API-Key on the Tinker /api/v1.
        headers = {"Authorization": f"Bearer {api_key}", "X-API-Key": api_key} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=5.0),
                                  headers=headers)

    def close(self) -> None:
        self._http.close()

    # -- error mapping -------------------------------------------------------------------------

    def _unreachable(self, exc: httpx.TransportError) -> CliError:
        if isinstance(exc, httpx.ConnectError):
            return CliError(f"cannot connect to the gateway at {self.base_url} ({exc})",
                            "is the gateway running? start it with `make up` (or `loopline up`), "
                            "or point --url / LOOPLINE_URL at it", EXIT_UNREACHABLE)
        if isinstance(exc, httpx.TimeoutException):
            return CliError(f"the gateway at {self.base_url} did not answer in time ({type(exc).__name__})",
                            "it may be overloaded or starting; try again, or check `loopline jobs`",
                            EXIT_UNREACHABLE)
        return CliError(f"lost the connection to the gateway at {self.base_url} ({exc!r})",
                        "try again; if it persists, check the gateway's log", EXIT_UNREACHABLE)

    def _check(self, response: httpx.Response, job: str | None, missing: Missing | None = None) -> None:
        if response.is_success:
            return
        detail = error_detail(response)
        status = response.status_code
        if status == 401:
            raise CliError(f"the gateway wants an API key: {detail}",
                           "give one of its keys with --api-key or LOOPLINE_API_KEY", EXIT_USER)
        if status == 404 and missing is not None and detail not in ("Not Found", ""):
            raise CliError(f"no such {missing.what} ({detail})", missing.hint, EXIT_USER)
        if status == 404 and job is not None:
            said = "" if detail in ("Not Found", "") else f" ({detail})"
            raise CliError(f"no such job: {job}{said}", "see `loopline jobs` for the jobs there are",
                           EXIT_USER)
        if status == 404:
            raise CliError(f"the gateway at {self.base_url} has no route {response.request.url.path}",
                           "is --url / LOOPLINE_URL a Loopline gateway with the training routes?", EXIT_USER)
        if status == 422 and job is not None:
            # Loopline's gateway answers 422 to a job prefix that names more than one job.
            raise CliError(f"cannot tell which job {job} is: {detail}",
                           "see `loopline jobs` for the jobs there are", EXIT_USER)
        if status == 409:
            raise CliError(f"not possible in the job's current state: {detail}",
                           "see `loopline status` for where the job is", EXIT_USER)
        if 400 <= status < 500:
            raise CliError(f"the gateway refused the request ({status}): {detail}", None, EXIT_USER)
        raise CliError(f"the gateway failed ({status}): {detail}",
                       "try again; if it persists, check the gateway's and trainer's logs", EXIT_FAILED)

    def _json(self, method: str, path: str, job: str | None = None, missing: Missing | None = None,
              **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        self._check(response, job, missing)
        try:
            return response.json()
        except ValueError:
            raise CliError(f"the gateway answered {path} with something that is not JSON: "
                           f"{response.text[:200]!r}") from None

    def _stream(self, path: str, job: str | None, read_timeout: float | None,
                params: dict[str, Any] | None = None, missing: Missing | None = None) -> Iterator[SseMessage]:
        """Messages of an event stream until the server ends it; a connection cut mid-stream ends it
        too (callers that must see the end of a job reconnect, they know what they have seen)."""
        timeout = httpx.Timeout(30.0, connect=5.0, read=read_timeout)
        try:
            with self._http.stream("GET", path, params=params, timeout=timeout) as response:
                if not response.is_success:
                    response.read()
                    self._check(response, job, missing)
                try:
                    yield from parse_sse(response.iter_lines())
                except (httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError):
                    return  # a quiet gap of read_timeout, or the connection was cut
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None

    # -- routes --------------------------------------------------------------------------------

    def submit(self, archive: IO[bytes], params: dict[str, Any]) -> dict[str, Any]:
        files = {"file": ("dataset", archive, "application/gzip")}
        # Uploads can be large and the server hashes them before answering.
        return self._json("POST", "/v1/megatron/train", files=files, data={"params": json.dumps(params)},
                          timeout=httpx.Timeout(600.0, connect=5.0))

    def get_job(self, job: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/megatron/train/{job}", job=job)

    def list_models(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/megatron/list_models").get("models", [])

    def control(self, action: str, job: str) -> dict[str, Any] | None:
        """cancel, delete or restart; ScalarLM answers ``null`` when the action failed inside."""
        return self._json("POST", f"/v1/megatron/{action}/{job}", job=job)

    def squeue(self) -> dict[str, Any]:
        return self._json("GET", "/v1/megatron/squeue")

    def events(self, job_hash: str, read_timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """JobEvents of one job: its history first, then live ones, until it ends."""
        for message in self._stream(f"/v1/megatron/train/{job_hash}/events", job_hash, read_timeout):
            try:
                event = json.loads(message.data)
            except ValueError:
                continue  # not an event (a heartbeat some proxy added); nothing to show
            if isinstance(event, dict):
                event.setdefault("kind", message.event)
                yield event

    def logs(self, job: str, starting_line_number: int = 0, follow: bool = True,
             read_timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """``{"line", "line_number"}`` records of the job's log. ``follow=false`` asks Loopline's
        gateway for what is there now; ScalarLM's ignores it and always follows, so ``read_timeout``
        also stops at the first quiet gap that long."""
        params = {"starting_line_number": starting_line_number, "follow": str(follow).lower()}
        for message in self._stream(f"/v1/megatron/train/logs/{job}", job, read_timeout, params):
            try:
                record = json.loads(message.data)
            except ValueError:
                continue
            if isinstance(record, dict) and "line" in record:
                yield record

    # -- Tinker routes (tinker_commands.py) -----------------------------------------------------

    def tinker_runs(self, limit: int, offset: int = 0) -> dict[str, Any]:
        """``{"training_runs": [TrainingRun...], "cursor": {"total_count", ...}}``, newest first."""
        return self._json("GET", "/api/v1/training_runs", params={"limit": limit, "offset": offset})

    def tinker_checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        missing = Missing(f"training run {run_id}", RUNS_HINT)
        return self._json("GET", f"/api/v1/training_runs/{run_id}/checkpoints",
                          missing=missing)["checkpoints"]

    def post_run_metrics(self, run_id: str, step: int | None, metrics: dict[str, float]) -> None:
        """Report a run's metrics at ``step`` (``/v1/tinker/runs/{run}/metrics``), for the dashboard."""
        body: dict[str, Any] = {"metrics": metrics, **({} if step is None else {"step": step})}
        self._json("POST", f"/v1/tinker/runs/{run_id}/metrics", json=body,
                   missing=Missing(f"training run {run_id}", RUNS_HINT))

    def tinker_sessions(self, limit: int) -> list[str]:
        """Session ids, newest first."""
        return self._json("GET", "/api/v1/sessions", params={"limit": limit})["sessions"]

    def tinker_session(self, session_id: str) -> dict[str, Any]:
        missing = Missing(f"session {session_id}", "see `loopline tinker sessions` for the sessions")
        return self._json("GET", f"/api/v1/sessions/{session_id}", missing=missing)

    def tinker_events(self, run_id: str | None = None, worker_id: str | None = None, *,
                      history: bool = False, after: int | None = None) -> Iterator[SseMessage]:
        """Session events: one run's or one worker's until it ends, else every worker's (from now,
        or ``history``: the stored ones first); ``after`` resumes after that event id."""
        params: dict[str, Any] = {} if after is None else {"after": after}
        if run_id is not None:
            path = f"/v1/tinker/runs/{run_id}/events"
            missing = Missing(f"training run {run_id}", RUNS_HINT)
        elif worker_id is not None:
            path = f"/v1/tinker/workers/{worker_id}/events"
            missing = Missing(f"session worker {worker_id}", "a worker id is in the events of "
                              "`loopline tinker follow`")
        else:
            path, missing = "/v1/tinker/events", None
            params["history"] = str(history).lower()
        yield from self._stream(path, None, None, params, missing)
