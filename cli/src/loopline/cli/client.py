"""The gateway's training routes over HTTP: requests, server-sent-event parsing, and the mapping of
every failure to a ``CliError`` that says what happened and what to do next."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"

# Exit codes: 1 = the job (or the server) failed; 2 = the user's input or job name is wrong (as
# click does for usage errors); 3 = the gateway cannot be reached at all.
EXIT_FAILED = 1
EXIT_USER = 2
EXIT_UNREACHABLE = 3


class CliError(Exception):
    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.message, self.hint, self.exit_code = message, hint, exit_code


@dataclass(frozen=True)
class SseMessage:
    event: str
    data: str


def parse_sse(lines: Iterable[str]) -> Iterator[SseMessage]:
    """Messages of a text/event-stream, given its lines without line endings.

    A bare JSON line outside the SSE framing is taken as one message too: ScalarLM's log stream is
    newline-delimited JSON under an event-stream content type, and the same parser serves both.
    """
    event, data = "", []
    for line in lines:
        if not line:
            if data:
                yield SseMessage(event or "message", "\n".join(data))
            event, data = "", []
            continue
        if line.startswith(":"):
            continue  # a comment: servers send these as keep-alives
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field in ("id", "retry"):
            pass
        elif line.lstrip().startswith(("{", "[")):
            yield SseMessage("message", line)
    if data:
        yield SseMessage(event or "message", "\n".join(data))


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


class Gateway:
    def __init__(self, base_url: str = DEFAULT_URL, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=5.0))

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

    def _check(self, response: httpx.Response, job: str | None) -> None:
        if response.is_success:
            return
        detail = error_detail(response)
        status = response.status_code
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

    def _json(self, method: str, path: str, job: str | None = None, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        self._check(response, job)
        try:
            return response.json()
        except ValueError:
            raise CliError(f"the gateway answered {path} with something that is not JSON: "
                           f"{response.text[:200]!r}") from None

    def _stream(self, path: str, job: str | None, read_timeout: float | None,
                params: dict[str, Any] | None = None) -> Iterator[SseMessage]:
        """Messages of an event stream until the server ends it; a connection cut mid-stream ends it
        too (callers that must see the end of a job reconnect, they know what they have seen)."""
        timeout = httpx.Timeout(30.0, connect=5.0, read=read_timeout)
        try:
            with self._http.stream("GET", path, params=params, timeout=timeout) as response:
                if not response.is_success:
                    response.read()
                    self._check(response, job)
                try:
                    yield from parse_sse(response.iter_lines())
                except (httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError):
                    return  # a quiet gap of read_timeout, or the connection was cut
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None

    # -- routes --------------------------------------------------------------------------------

    def submit(self, archive: BinaryIO, params: dict[str, Any]) -> dict[str, Any]:
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
