"""Every size a client chooses is bounded before the gateway works for it (issue 23): a 4xx that names
the limit and its setting (``LOOPLINE_*``), and the gateway's peak RSS stays within a stated bound
(RSS_BOUND) while it refuses.

The gateway is its own process on a real nats-server, with nothing else (no trainer, no replica):
every refusal here comes before any of them would be asked. Its peak RSS is the kernel's high-water
mark (``VmHWM``), reset before each request (``clear_refs``), next to psutil's current RSS.
"""

from __future__ import annotations

import gzip
import io
import json
import threading
import time
import zlib

import httpx
import pytest

from loopline.common.contracts import subjects, tinker_names
from loopline.common.contracts.tinker_schemas import TinkerSampler
from loopline.common.local import launcher
from loopline.common.runtime.tinker_store import TinkerStore
from support.bus_view import BusView
from support.gateway_process import BASE_MODEL, start_gateway
from support.peak_rss import PeakRss

MiB = 1024 * 1024
MAX_SAMPLES = 8
MAX_IDS = 50
MAX_CHUNKS = 16
MAX_LINE = 64 * 1024
MAX_LIST = 100
MAX_STREAMS = 2
MAX_BODY = 1 * MiB
MAX_UPLOAD = 128 * MiB
MAX_SESSIONS = 3
SESSIONS_TTL_S = 600
# What one refused request may add to the gateway's peak RSS: a few blocks of a stream and the
# request's own objects. Unbounded, each of these requests cost 100 MB or more (noted per test).
RSS_BOUND = 40 * MiB


@pytest.fixture(scope="module")
def gateway(nats_proc, tmp_path_factory):
    gw = start_gateway(
        nats_proc.info["url"], tmp_path_factory.mktemp("limits"),
        LOOPLINE_MAX_SAMPLES_PER_REQUEST=str(MAX_SAMPLES), LOOPLINE_MAX_IDS_PER_POLL=str(MAX_IDS),
        LOOPLINE_MAX_UPLOAD_CHUNKS=str(MAX_CHUNKS), LOOPLINE_MAX_DATASET_LINE_BYTES=str(MAX_LINE),
        LOOPLINE_MAX_LIST_LIMIT=str(MAX_LIST), LOOPLINE_MAX_STREAMS_PER_KEY=str(MAX_STREAMS),
        LOOPLINE_MAX_BODY_BYTES=str(MAX_BODY), LOOPLINE_MAX_UPLOAD_BYTES=str(MAX_UPLOAD),
        LOOPLINE_MAX_DATASET_BYTES=str(1024 * MiB), LOOPLINE_MAX_CHUNK_BYTES=str(8 * MiB),
        LOOPLINE_MAX_TINKER_SESSIONS_PER_KEY=str(MAX_SESSIONS),
        LOOPLINE_TINKER_SESSIONS_MAX_AGE_S=str(SESSIONS_TTL_S))
    yield gw
    launcher.stop(gw.proc)


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        yield client


def names(resp: httpx.Response, setting: str) -> bool:
    return setting in resp.text


# --- num_samples and n -----------------------------------------------------------------------------
def sample_request(num_samples: int) -> dict:
    return {"num_samples": num_samples, "base_model": BASE_MODEL,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"temperature": 0, "max_tokens": 1}}


def test_tinker_num_samples_beyond_the_limit_is_400_before_any_work(http, gateway):
    """Before: num_samples=10**9 at temperature 0 made the reply list a billion sequence ids, and
    the gateway grew to 22 GB until the OOM killer took it (and `make up` with it)."""
    with PeakRss(gateway.proc.pid) as rss:
        resp = http.post("/api/v1/asample", json=sample_request(10**9))
    assert resp.status_code == 400, resp.text
    assert names(resp, "LOOPLINE_MAX_SAMPLES_PER_REQUEST") and f"limit is {MAX_SAMPLES}" in resp.text
    assert rss.growth < RSS_BOUND, rss.growth
    # At the limit the count is let through (and the request goes on: here, no replica serves it).
    resp = http.post("/api/v1/asample", json=sample_request(MAX_SAMPLES))
    assert not names(resp, "LOOPLINE_MAX_SAMPLES_PER_REQUEST"), resp.text
    resp = http.post("/api/v1/asample", json=sample_request(0))
    assert resp.status_code == 400 and "num_samples=0" in resp.text


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_openai_n_beyond_the_limit_is_400_in_openais_shape(http, gateway, field):
    with PeakRss(gateway.proc.pid) as rss:
        resp = http.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "x", field: 10**9})
    assert resp.status_code == 400, resp.text
    assert rss.growth < RSS_BOUND, rss.growth
    error = resp.json()["error"]
    assert error["param"] == field and "LOOPLINE_MAX_SAMPLES_PER_REQUEST" in error["message"]
    resp = http.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "x", field: MAX_SAMPLES})
    assert not names(resp, "LOOPLINE_MAX_SAMPLES_PER_REQUEST"), resp.text


# --- get_results ------------------------------------------------------------------------------------
def test_more_request_ids_than_the_limit_in_one_poll_is_413(http, gateway):
    ids = [f"{'a' * 64}_{i:09d}" for i in range(MAX_IDS + 1)]
    started = time.monotonic()
    with PeakRss(gateway.proc.pid) as rss:
        resp = http.post("/v1/generate/get_results", json={"request_ids": ids})
    assert resp.status_code == 413, resp.text
    assert rss.growth < RSS_BOUND, rss.growth
    assert names(resp, "LOOPLINE_MAX_IDS_PER_POLL") and time.monotonic() - started < 5
    # At the limit they are looked up (unknown here: 404 at once).
    resp = http.post("/v1/generate/get_results", json={"request_ids": ids[:MAX_IDS]})
    assert resp.status_code == 404, resp.text


def test_a_request_id_with_a_huge_index_is_400_not_500(http, gateway):
    """Before: a 4,300-digit index passed the id check and int() refused it: a 500."""
    with PeakRss(gateway.proc.pid) as rss:
        resp = http.post("/v1/generate/get_results", json={"request_ids": [f"{'a' * 64}_{'9' * 4300}"]})
    assert resp.status_code == 400, resp.text
    assert rss.growth < RSS_BOUND, rss.growth
    detail = resp.json()["detail"]
    assert "malformed request id" in detail and "index digits" in detail and len(detail) < 1000


# --- chunked upload ---------------------------------------------------------------------------------
def init(http: httpx.Client, total: int, chunk: int, count: int) -> httpx.Response:
    return http.post("/v1/megatron/upload/init", json={
        "total_size": total, "total_hash": "ab" * 32, "chunk_size": chunk, "num_chunks": count})


def test_a_chunked_upload_of_more_chunks_than_the_limit_is_413_at_init(http, gateway):
    """Before: chunk_size=1 for 1 GiB was accepted, and init and finalize looked up a billion
    chunks, one coroutine each."""
    total = 64 * MiB
    started = time.monotonic()
    with PeakRss(gateway.proc.pid) as rss:
        resp = init(http, total, 1, total)
        assert resp.status_code == 413 and names(resp, "LOOPLINE_MAX_UPLOAD_CHUNKS"), resp.text
        # A count that does not match its sizes is refused by the sizes, not by the count sent.
        resp = init(http, total, 1, 1)
        assert resp.status_code == 413 and names(resp, "LOOPLINE_MAX_UPLOAD_CHUNKS"), resp.text
    assert time.monotonic() - started < 5
    assert rss.growth < RSS_BOUND, rss.growth
    resp = init(http, MAX_CHUNKS * MiB, MiB, MAX_CHUNKS)
    assert resp.status_code == 200, resp.text
    assert resp.json()["received_chunks"] == []


# --- one dataset line -------------------------------------------------------------------------------
def gzip_of_one_line(length: int) -> bytes:
    """A gzip of one dataset line ``length`` bytes long, made without holding the line."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    parts = [deflate.compress(b'{"input": "')]
    block = b"a" * MiB
    for _ in range(length // MiB):
        parts.append(deflate.compress(block))
    parts.append(deflate.compress(b'", "output": "b"}\n'))
    parts.append(deflate.flush())
    return b"".join(parts)


def test_a_dataset_line_beyond_the_limit_is_413_while_it_streams(http, gateway):
    """Before: a 39 KB gzip holding one 40 MB line peaked at 120 MB (the line whole, decoded, parsed);
    here a 100 MB line, refused once the limit's worth of it has been read."""
    archive = gzip_of_one_line(100 * MiB)
    assert len(archive) < 1 * MiB
    with PeakRss(gateway.proc.pid) as rss:
        resp = http.post("/v1/megatron/train", files={"file": ("dataset.jsonlines.gz", archive)})
    assert resp.status_code == 413, resp.text
    assert names(resp, "LOOPLINE_MAX_DATASET_LINE_BYTES") and "line 1" in resp.text
    assert rss.growth < RSS_BOUND, rss.growth


# --- /v1/generate/upload ----------------------------------------------------------------------------
def test_generate_upload_is_read_as_a_stream(http, gateway):
    """Before: the file was read whole and parsed with json.loads (64 MB of prompts: about 200 MB
    at the peak) before anything was checked. Here its last request is malformed: every entry is
    read and checked, one at a time, and the peak stays within the bound."""
    prompt = "p" * 1000
    entry = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    count = 64 * MiB // (len(entry) + 1)
    body = io.BytesIO()
    body.write(b"[")
    for _ in range(count):
        body.write(entry + b",")
    body.write(b'{"prompt": 5}]')
    with PeakRss(gateway.proc.pid) as rss:
        resp = http.post("/v1/generate/upload", files={"file": ("requests.json", body.getvalue())})
    assert resp.status_code == 400, resp.text
    assert f"request {count} must be a string" in resp.json()["detail"]
    assert rss.growth < RSS_BOUND, rss.growth


def test_one_upload_request_larger_than_a_body_is_413(http):
    body = b'[{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}]'
    resp = http.post("/v1/generate/upload", files={"file": ("requests.json", body)})
    assert resp.status_code == 413 and names(resp, "LOOPLINE_MAX_BODY_BYTES"), resp.text
    assert "request 0" in resp.text


def test_an_upload_that_is_not_an_array_is_400(http):
    for body in (b"not json", b"{}", b"[", b'[{"prompt": "x"},]', b"[]"):
        resp = http.post("/v1/generate/upload", files={"file": ("requests.json", body)})
        assert resp.status_code == 400, (body, resp.text)


# --- list limits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["/api/v1/training_runs", "/api/v1/sessions"])
def test_a_list_limit_beyond_the_limit_is_400(http, gateway, route):
    with PeakRss(gateway.proc.pid) as rss:
        resp = http.get(route, params={"limit": 10**9})
    assert resp.status_code == 400 and names(resp, "LOOPLINE_MAX_LIST_LIMIT"), resp.text
    assert rss.growth < RSS_BOUND, rss.growth
    resp = http.get(route, params={"limit": MAX_LIST + 1})
    assert resp.status_code == 400 and names(resp, "LOOPLINE_MAX_LIST_LIMIT"), resp.text
    for bad in ({"limit": -1}, {"offset": -5}):
        resp = http.get(route, params=bad)
        assert resp.status_code == 400 and "must be 0 or more" in resp.text, resp.text
    assert http.get(route, params={"limit": MAX_LIST}).status_code == 200


# --- open event streams -----------------------------------------------------------------------------
def test_open_event_streams_per_client_are_capped(gateway):
    """Without keys the holder is the client's address: MAX_STREAMS streams stay open, one more is
    429 naming the setting; once one closes, a stream opens again."""
    close = threading.Event()
    opened: list[threading.Event] = []

    def hold(route: str, ready: threading.Event) -> None:
        with httpx.stream("GET", f"{gateway.url}{route}", timeout=30) as stream:
            assert stream.status_code == 200
            ready.set()
            close.wait(30)

    threads = []
    for route in ("/v1/megatron/events", "/v1/tinker/events"):
        ready = threading.Event()
        opened.append(ready)
        threads.append(threading.Thread(target=hold, args=(route, ready), daemon=True))
        threads[-1].start()
    try:
        assert all(ready.wait(10) for ready in opened)
        with PeakRss(gateway.proc.pid) as rss:
            refused = httpx.get(f"{gateway.url}/v1/megatron/events", timeout=10)
        assert refused.status_code == 429, refused.text
        assert rss.growth < RSS_BOUND, rss.growth
        assert names(refused, "LOOPLINE_MAX_STREAMS_PER_KEY") and f"limit is {MAX_STREAMS}" in refused.text
    finally:
        close.set()
        for thread in threads:
            thread.join(10)
    # The closed streams gave their slots back (the server notices the client gone at its next write,
    # a keep-alive at the latest: poll a little).
    deadline = time.monotonic() + 20
    while True:
        with httpx.stream("GET", f"{gateway.url}/v1/megatron/events", timeout=10) as stream:
            if stream.status_code == 200:
                break
        assert time.monotonic() < deadline, "the closed streams' slots were not given back"
        time.sleep(0.5)


def test_a_gzip_line_within_the_limit_is_not_refused_for_its_length(http):
    line = json.dumps({"input": "x" * (MAX_LINE - 40), "output": "y"}).encode() + b"\n"
    assert len(line) <= MAX_LINE
    resp = http.post("/v1/megatron/train", files={"file": ("dataset.jsonlines.gz", gzip.compress(line))})
    # No trainer runs here: the archive was read and accepted, then the trainer was asked (503/504).
    assert not names(resp, "LOOPLINE_MAX_DATASET_LINE_BYTES"), resp.text
    assert resp.status_code in (503, 504), resp.text


# --- Tinker sessions and sampling sessions ----------------------------------------------------------
SESSION_REQUEST = {"tags": [], "user_metadata": None, "sdk_version": "0"}


def test_tinker_sessions_per_key_are_capped_and_their_buckets_expire(http, gateway, nats_proc):
    """Before: any client could fill TINKER_SESSIONS and TINKER_SAMPLERS, one record per request,
    kept forever. Now the buckets keep a record LOOPLINE_TINKER_SESSIONS_MAX_AGE_S past its last
    write, and one key (here: one client address) creates at most MAX_SESSIONS within that time."""
    with PeakRss(gateway.proc.pid) as rss:
        created = [http.post("/api/v1/create_session", json=SESSION_REQUEST)
                   for _ in range(MAX_SESSIONS)]
        assert [r.status_code for r in created] == [200] * MAX_SESSIONS, created[-1].text
        refused = http.post("/api/v1/create_session", json=SESSION_REQUEST)
    assert refused.status_code == 429, refused.text
    assert rss.growth < RSS_BOUND, rss.growth
    assert names(refused, "LOOPLINE_MAX_TINKER_SESSIONS_PER_KEY")
    assert f"limit is {MAX_SESSIONS}" in refused.text
    assert 0 < int(refused.headers["retry-after"]) <= SESSIONS_TTL_S

    async def ttls(nc):
        js = nc.jetstream()
        return [(await js.stream_info(f"KV_{bucket}")).config.max_age
                for bucket in (subjects.TINKER_SESSIONS_BUCKET, subjects.TINKER_SAMPLERS_BUCKET)]

    assert BusView(nats_proc.info["url"]).ask(ttls) == [SESSIONS_TTL_S, SESSIONS_TTL_S]


def test_a_sampling_session_in_use_is_written_again_before_it_expires(http, nats_proc):
    """A sampling session last written more than half the TTL ago is written again when it is used,
    so the TTL takes only abandoned ones (the sample itself then fails here: no replica)."""
    view = BusView(nats_proc.info["url"])
    old = time.time() - SESSIONS_TTL_S * 0.75
    sampler = TinkerSampler(sampling_session_id=tinker_names.new_id(), base_model=BASE_MODEL, created_at=old)

    async def put(nc):
        store = TinkerStore(nc.jetstream(), nc.max_payload)
        await store.start()
        await store.put_sampler(sampler)

    async def read(nc):
        store = TinkerStore(nc.jetstream(), nc.max_payload)
        await store.start()
        return await store.sampler(sampler.sampling_session_id)

    view.ask(put)
    body = {**sample_request(1), "sampling_session_id": sampler.sampling_session_id}
    del body["base_model"]
    http.post("/api/v1/asample", json=body)
    written = view.ask(read)
    assert written is not None and written.written > time.time() - 60, written


def test_with_keys_open_event_streams_are_counted_per_key(nats_proc, tmp_path_factory):
    """With keys, the holder is the key: one key at its limit is refused, another on the same
    address is not."""
    keys = ["key-one-" + "x" * 24, "key-two-" + "y" * 24]
    gw = start_gateway(nats_proc.info["url"], tmp_path_factory.mktemp("keyed"),
                       LOOPLINE_API_KEYS=",".join(keys), LOOPLINE_MAX_STREAMS_PER_KEY="1")
    close = threading.Event()
    ready = threading.Event()

    def hold() -> None:
        with httpx.stream("GET", f"{gw.url}/v1/megatron/events", timeout=30,
                          headers={"Authorization": f"Bearer {keys[0]}"}) as stream:
            assert stream.status_code == 200
            ready.set()
            close.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert ready.wait(10)
        refused = httpx.get(f"{gw.url}/v1/megatron/events", timeout=10,
                            headers={"Authorization": f"Bearer {keys[0]}"})
        assert refused.status_code == 429 and names(refused, "LOOPLINE_MAX_STREAMS_PER_KEY"), refused.text
        assert "key 'LOOPLINE_API_KEYS#" in refused.text  # the key's name, never the key
        assert keys[0] not in refused.text
        with httpx.stream("GET", f"{gw.url}/v1/megatron/events", timeout=10,
                          headers={"Authorization": f"Bearer {keys[1]}"}) as other:
            assert other.status_code == 200
    finally:
        close.set()
        holder.join(10)
        launcher.stop(gw.proc)
