"""NATS connection, stream and consumer helpers shared by every service.

The bus must ride out a restarted nats-server: connections reconnect forever, and a publish that must
be durable is retried with the same ``Nats-Msg-Id`` until JetStream acknowledges it (the server's
dedupe window makes the retry safe).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, NoRespondersError, TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError
from nats.js.object_store import OBJ_ALL_META_PRE_TEMPLATE, OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from loopline.common.config.settings import CommonSettings, MiB
from loopline.common.contracts import subjects
from loopline.common.runtime.telemetry import inject_trace_headers

log = logging.getLogger(__name__)

WORK_MAX_AGE_S = 24 * 3600
# Tinker calls, futures and blobs: a day covers any client's long-poll and retries of a call.
TINKER_MAX_AGE_S = 24 * 3600
# Long enough to cover a nats-server restart during which publishers keep retrying.
DEDUPE_WINDOW_S = 600


async def connect(url: str, name: str) -> NATS:
    async def on_error(exc: Exception) -> None:
        log.warning("nats %s: %s", name, exc)

    async def on_disconnect() -> None:
        log.warning("nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.info("nats %s: reconnected", name)

    return await nats.connect(
        servers=[url],
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        connect_timeout=2,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        # Publishes made while reconnecting are buffered, then flushed on reconnect.
        pending_size=64 * 1024 * 1024,
    )


async def kv_keys(js: JetStreamContext, bucket: str, under: str | None = None) -> list[str]:
    """A KV bucket's keys (those starting ``under.``), from its stream's subject counts. Not
    nats-py's ``kv.keys()``: each call of that leaves a consumer on the bucket for five minutes (the
    gateway's 2 s model refresh piled ~150 onto KV_MODELS; the trainer's 0.25 s reconcile in the
    tests reached the server's 1,000-consumer limit within four minutes), and it can answer "none"
    under load while the bucket holds keys. A deleted key keeps its marker's subject: reading it
    finds nothing."""
    prefix = f"$KV.{bucket}."
    wanted = f"{prefix}{under}.>" if under else f"{prefix}>"
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=wanted)
    return [subject[len(prefix):] for subject in (info.state.subjects or {})]


async def purge_objects(js: JetStreamContext, bucket: str, prefix: str) -> int:
    """Remove every object of ``bucket`` whose name starts with ``prefix``, chunks and metadata (no
    delete marker stays behind); returns how many. The names come from the stream's subject counts,
    not nats-py's ``list()``, which leaves a consumer behind for every call."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    meta_all = OBJ_ALL_META_PRE_TEMPLATE.format(bucket=bucket)
    info = await js.stream_info(stream, subjects_filter=meta_all)
    removed = 0
    # Invariant: every object counted in ``removed`` has neither its metadata nor its chunks left.
    for meta_subject in info.state.subjects or {}:
        encoded = meta_subject[len(meta_all) - 1:]
        try:
            name = base64.urlsafe_b64decode(encoded).decode()
        except ValueError:
            continue  # not a name nats-py wrote
        if not name.startswith(prefix):
            continue
        try:
            meta = await js.get_last_msg(stream, meta_subject)
            chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=json.loads(meta.data or b"{}")["nuid"])
        except (NotFoundError, KeyError, ValueError):
            chunks = None
        # The metadata first: a reader that finds no metadata finds no object, never half of one.
        await js.purge_stream(stream, subject=meta_subject)
        if chunks:
            await js.purge_stream(stream, subject=chunks)
        removed += 1
    return removed


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with another config (an older version of ours): bring it up to date.
        try:
            await js.update_stream(config)
        except (TimeoutError, NatsTimeoutError, NoRespondersError) as exc:
            # Under nats_permissions only the queue may update a stream (a refused request is never
            # answered); another service started first keeps working with the old config until
            # the queue applies it. A config the server refuses (APIError) still stops the start.
            log.error("could not bring the %s stream's configuration up to date (%s): it keeps the "
                      "old one until a role allowed to update streams applies it", config.name, exc)


async def ensure_key_value_ttl(js: JetStreamContext, bucket: str, ttl_s: float) -> None:
    """The KV bucket ``bucket`` (history 1) with each key kept ``ttl_s`` past its last put; an
    existing one is brought to that TTL (its stream's max age)."""
    stream = f"KV_{bucket}"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s,
                                                 storage=StorageType.FILE))
        return
    if abs((info.config.max_age or 0) - ttl_s) > 1e-3:
        info.config.max_age = ttl_s
        if (info.config.duplicate_window or 0) > ttl_s:
            info.config.duplicate_window = ttl_s  # the server refuses a window past the max age
        try:
            await js.update_stream(info.config)
        except (APIError, TimeoutError, NatsTimeoutError, NoRespondersError) as exc:
            # As ensure_object_store: a credential that may not update streams leaves the old TTL.
            log.error("could not set the %s bucket's TTL to %g s (%s): it keeps %g s until a role "
                      "allowed to update streams applies it", bucket, ttl_s, exc, info.config.max_age or 0)


@dataclass(frozen=True)
class Retention:
    """How long NATS keeps results, datasets, adapters and Tinker sessions: CommonSettings'
    ``*_max_age_s`` (their
    descriptions say what each covers and why its default is safe); 0 keeps forever."""

    results_max_age_s: float
    datasets_max_age_s: float
    adapters_max_age_s: float
    tinker_sessions_max_age_s: float = 24 * 3600
    events_max_bytes: int = 512 * MiB

    @classmethod
    def of(cls, settings: CommonSettings) -> Retention:
        return cls(settings.results_max_age_s, settings.datasets_max_age_s, settings.adapters_max_age_s,
                   settings.tinker_sessions_max_age_s, settings.events_max_bytes)


async def ensure_object_store(js: JetStreamContext, bucket: str, ttl_s: float) -> None:
    """The object store ``bucket`` with its objects kept ``ttl_s`` (0: forever); an existing one is
    brought to that TTL (nats-py's object store has no config update: its stream is updated)."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        await js.create_object_store(bucket, ObjectStoreConfig(storage=StorageType.FILE, ttl=ttl_s))
        return
    if abs((info.config.max_age or 0) - ttl_s) > 1e-3:
        info.config.max_age = ttl_s
        if ttl_s and (info.config.duplicate_window or 0) > ttl_s:
            info.config.duplicate_window = ttl_s  # the server refuses a window past the max age
        try:
            await js.update_stream(info.config)
        except (APIError, TimeoutError, NatsTimeoutError, NoRespondersError) as exc:
            # A credential that may create but not update streams (nats_permissions): the store
            # keeps working with its old TTL; a service ending here would end every service.
            log.error("could not set the %s object store's TTL to %g s (%s): it keeps %g s until "
                      "a role allowed to update streams applies it", bucket, ttl_s, exc,
                      info.config.max_age or 0)


async def ensure_topology(js: JetStreamContext, *, max_work_msgs: int = 1_000_000,
                          retention: Retention | None = None) -> None:
    """Create the streams and buckets every service relies on; idempotent, any service may call it.
    ``retention`` unset: the one LOOPLINE_*_MAX_AGE_S in the environment say, as services read it."""
    retention = retention or Retention.of(CommonSettings())
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.WORK_STREAM,
            subjects=[subjects.WORK_ALL],
            # A work item lives until both the inference replicas and the ledger have acked it.
            retention=RetentionPolicy.INTEREST,
            storage=StorageType.FILE,
            max_age=WORK_MAX_AGE_S,
            max_msgs=max_work_msgs,
            discard=DiscardPolicy.NEW,
            duplicate_window=DEDUPE_WINDOW_S,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.RESULTS_STREAM,
            subjects=[subjects.RESULTS_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=retention.results_max_age_s,
            # Results are idempotent by request id: a redelivered request's second answer is dropped.
            # (The server refuses a window longer than the stream's max age.)
            duplicate_window=min(DEDUPE_WINDOW_S, retention.results_max_age_s),
            allow_direct=True,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.EVENTS_STREAM,
            subjects=[subjects.EVENTS_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=7 * 24 * 3600,
            # Clients make events at their own rate: the oldest go rather than a publish failing,
            # and the stream never takes the store WORK and RESULTS need.
            max_bytes=retention.events_max_bytes,
            discard=DiscardPolicy.OLD,
            # The trainer republishes job events it is unsure about after a restart; the same
            # Nats-Msg-Id within this window is dropped, so no event is seen twice.
            duplicate_window=DEDUPE_WINDOW_S,
        ),
    )
    # Advisories are core messages; captured in a stream, a dead letter announced while no queue
    # replica runs is handled when one starts.
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.ADVISORIES_STREAM,
            subjects=[subjects.max_deliveries_advisory()],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_age=WORK_MAX_AGE_S,
        ),
    )
    await _ensure_consumer(js, subjects.ADVISORIES_STREAM, subjects.DEAD_LETTERS_DURABLE,
                           subjects.max_deliveries_advisory())
    # The ledger's consumers exist from the start: WORK keeps a message only while some consumer
    # is interested, so the ledger must be interested before the first request is published.
    await _ensure_consumer(js, subjects.WORK_STREAM, subjects.LEDGER_WORK_DURABLE, subjects.WORK_ALL)
    await _ensure_consumer(js, subjects.RESULTS_STREAM, subjects.LEDGER_RESULTS_DURABLE, subjects.RESULTS_ALL)
    for bucket in (subjects.MODELS_BUCKET, subjects.BATCHES_BUCKET):
        try:
            await js.key_value(bucket)
        except NotFoundError:  # key_value raises BucketNotFoundError, a NotFoundError
            # A batch's manifest is what its results are found by: kept as long as they are.
            ttl = retention.results_max_age_s if bucket == subjects.BATCHES_BUCKET else 0
            await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1, ttl=ttl, storage=StorageType.FILE)
            )
    # Latest checkpoint of each job; a replica that starts later reads the last one per subject.
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.CHECKPOINTS_STREAM,
            subjects=[subjects.CHECKPOINTS_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            duplicate_window=DEDUPE_WINDOW_S,
        ),
    )
    await ensure_tinker_topology(js, retention.tinker_sessions_max_age_s)
    await ensure_object_store(js, subjects.DATASETS_BUCKET, retention.datasets_max_age_s)
    await ensure_object_store(js, subjects.ADAPTERS_BUCKET, retention.adapters_max_age_s)


async def ensure_tinker_topology(js: JetStreamContext, sessions_max_age_s: float = 24 * 3600) -> None:
    """The Tinker API's streams and buckets (subjects.py says what each holds); sessions and
    sampling sessions live ``sessions_max_age_s`` past their last write."""
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.TINKER_CALLS_STREAM,
            subjects=[subjects.TINKER_CALLS_ALL],
            # A call lives until its worker has answered it: what is left belongs to no answer yet,
            # and is what the trainer fails when the worker dies.
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_age=TINKER_MAX_AGE_S,
            # An SDK retry of one call has the same request id (tinker_names.request_id).
            duplicate_window=DEDUPE_WINDOW_S,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.TINKER_FUTURES_STREAM,
            subjects=[subjects.TINKER_FUTURES_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=TINKER_MAX_AGE_S,
            max_msgs_per_subject=1,
            duplicate_window=DEDUPE_WINDOW_S,
            allow_direct=True,
        ),
    )
    for bucket in (subjects.TINKER_MODELS_BUCKET, subjects.TINKER_WORKERS_BUCKET,
                   subjects.TINKER_CHECKPOINTS_BUCKET):
        try:
            await js.key_value(bucket)
        except NotFoundError:
            await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE))
    for bucket in (subjects.TINKER_SESSIONS_BUCKET, subjects.TINKER_SAMPLERS_BUCKET):
        # Once unbounded: any client could fill them, one small record per request.
        await ensure_key_value_ttl(js, bucket, sessions_max_age_s)
    try:
        await js.object_store(subjects.TINKER_BLOBS_BUCKET)
    except Exception:  # noqa: BLE001 - nats-py raises several kinds for "no such bucket"
        await js.create_object_store(subjects.TINKER_BLOBS_BUCKET, ObjectStoreConfig(
            storage=StorageType.FILE, ttl=TINKER_MAX_AGE_S))


async def _ensure_consumer(js: JetStreamContext, stream: str, durable: str, subject: str, **kw) -> None:
    config = ConsumerConfig(
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        max_ack_pending=kw.pop("max_ack_pending", 20_000),
        **kw,
    )
    try:
        await js.add_consumer(stream, config)
    except BadRequestError:
        pass  # exists already, possibly with settings a running service chose


async def ensure_work_consumer(
    js: JetStreamContext, deployment: str, *, ack_wait_s: float, max_deliver: int
) -> None:
    """The durable pull consumer all inference replicas of one deployment share."""
    await _ensure_consumer(
        js,
        subjects.WORK_STREAM,
        subjects.inference_durable(deployment),
        subjects.work(deployment),
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
    )


async def publish_durable(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    msg_id: str,
    headers: Mapping[str, str] | None = None,
    deadline_s: float = 120.0,
) -> PubAck:
    """Publish to JetStream and wait for its ack, retrying through outages until ``deadline_s``.

    Raises ``StreamFull`` when the stream refuses for its limits (the caller answers 429).
    """
    hdrs = {"Nats-Msg-Id": msg_id, **(headers or {})}
    inject_trace_headers(hdrs)
    give_up = time.monotonic() + deadline_s
    delay = 0.05
    while True:
        try:
            return await js.publish(subject, payload, headers=hdrs, timeout=2.0)
        except APIError as exc:
            if "maximum messages" in str(exc) or "maximum bytes" in str(exc):
                raise StreamFull(str(exc)) from exc
            err: Exception = exc
        except (TimeoutError, NatsTimeoutError, NoRespondersError, ConnectionClosedError) as exc:
            err = exc
        if time.monotonic() > give_up:
            raise BusUnavailable(f"could not publish to {subject}: {err}") from err
        log.debug("retrying publish to %s after %s", subject, err)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


class StreamFull(Exception):
    """JetStream refused a message because a stream limit is reached."""


class BusUnavailable(Exception):
    """NATS did not acknowledge in time; nothing was accepted."""
