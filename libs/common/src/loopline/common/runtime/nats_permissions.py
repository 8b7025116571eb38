"""Who may publish and subscribe to what on NATS: one user per Loopline role, least privilege.

Every role's permissions are built here, once, from the names in subjects.py, and
``nats_auth.server_config`` turns them into nats-server's ``authorization`` block (docker compose,
Helm, and ``LocalStack(nats_auth=True)`` all run that). docs/security.md has the table of roles and
what stays coarse.

JetStream is driven through core subjects, so its API is permitted subject by subject:
``$JS.API.STREAM.CREATE.<stream>``, ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``, acks on
``$JS.ACK.<stream>.>``, a KV bucket's keys on ``$KV.<bucket>.>`` (its stream ``KV_<bucket>``), an
object store's chunks on ``$O.<bucket>.>`` (its stream ``OBJ_<bucket>``). Answers to requests are
allowed by ``allow_responses`` (a responder may publish once to the reply subject of a request it
received), so no role may publish to another's ``_INBOX`` at will.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopline.common.contracts import subjects

GATEWAY = "gateway"
QUEUE = "queue"
INFERENCE = "inference"
TRAINER = "trainer"
CHECKPOINT_WATCHER = "checkpoint-watcher"
TINKER_WORKER = "tinker-worker"
ROLES = (GATEWAY, QUEUE, INFERENCE, TRAINER, CHECKPOINT_WATCHER, TINKER_WORKER)

JS_API = "$JS.API"
INBOXES = "_INBOX.>"  # nats-py's replies (requests, JetStream acks, push consumers' deliveries)
SERVICES = "$SRV.>"  # nats.micro's PING, INFO and STATS, by name and by instance


@dataclass
class Permissions:
    """One role's allow lists; anything not listed is refused by the server."""

    publish: set[str] = field(default_factory=set)
    subscribe: set[str] = field(default_factory=set)

    def merge(self, other: Permissions) -> Permissions:
        return Permissions(self.publish | other.publish, self.subscribe | other.subscribe)


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


# --- building blocks -----------------------------------------------------------------------------
def stream_reader(stream: str) -> Permissions:
    """Read ``stream``: its info, a message by sequence or last-by-subject (direct or not), its
    consumers created (ephemeral push, durable pull), fetched from, acked, flow-controlled, deleted
    (an ephemeral consumer is deleted when its subscription ends)."""
    return Permissions(publish={
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.INFO.{stream}.>",
        f"{JS_API}.CONSUMER.DELETE.{stream}.>",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    })


def publisher(*subject_filters: str) -> Permissions:
    """Publish to these subjects (to a stream's subject: JetStream stores it and acks to an inbox)."""
    return Permissions(publish=set(subject_filters))


def listener(*subject_filters: str) -> Permissions:
    """Subscribe with core NATS to these subjects (messages as they are published)."""
    return Permissions(subscribe=set(subject_filters))


def kv_reader(bucket: str) -> Permissions:
    return stream_reader(_kv_stream(bucket))


def kv_writer(bucket: str) -> Permissions:
    return kv_reader(bucket).merge(publisher(f"$KV.{bucket}.>"))


def object_reader(bucket: str) -> Permissions:
    """Read objects. nats-py's get subscribes to the chunks without naming the stream, so it first
    asks which stream holds them (``STREAM.NAMES``: every stream's name, nothing of its content)."""
    return stream_reader(_object_stream(bucket)).merge(publisher(f"{JS_API}.STREAM.NAMES"))


def object_writer(bucket: str) -> Permissions:
    """Put and delete objects. nats-py's put of a name that exists purges the old chunks, and a delete
    purges them too: this purge is of this bucket's stream only."""
    return object_reader(bucket).merge(publisher(
        f"$O.{bucket}.>", f"{JS_API}.STREAM.PURGE.{_object_stream(bucket)}"))


def adapter_retirer() -> Permissions:
    """adapter_retire.retire (a deleted job, by the trainer; by the watcher when a delete raced its
    announcement): purge the job's announcements, adapter objects and adapter events, announce it
    retired. Purges are per stream: CHECKPOINTS and EVENTS whole, not one job's subjects."""
    purged = (subjects.CHECKPOINTS_STREAM, subjects.EVENTS_STREAM, _object_stream(subjects.ADAPTERS_BUCKET))
    return object_reader(subjects.ADAPTERS_BUCKET).merge(publisher(
        *(f"{JS_API}.STREAM.PURGE.{stream}" for stream in purged), subjects.adapter_event("*", "retired")))


def service_responder(*endpoint_subjects: str) -> Permissions:
    """A nats.micro service: its $SRV subjects and endpoints; answers go out by allow_responses."""
    return listener(SERVICES, *endpoint_subjects)


def service_caller(*endpoint_subjects: str) -> Permissions:
    return Permissions(publish=set(endpoint_subjects), subscribe={INBOXES})


TINKER_BUCKETS = (subjects.TINKER_SESSIONS_BUCKET, subjects.TINKER_MODELS_BUCKET,
                  subjects.TINKER_WORKERS_BUCKET, subjects.TINKER_SAMPLERS_BUCKET,
                  subjects.TINKER_CHECKPOINTS_BUCKET)
# Streams and buckets of bus.ensure_topology: every service creates what is missing at start
# (idempotent: CREATE of an existing stream with the same config answers its info).
TOPOLOGY_STREAMS = (
    subjects.WORK_STREAM, subjects.RESULTS_STREAM, subjects.EVENTS_STREAM, subjects.ADVISORIES_STREAM,
    subjects.CHECKPOINTS_STREAM, subjects.TINKER_CALLS_STREAM, subjects.TINKER_FUTURES_STREAM,
    *(_kv_stream(b) for b in (subjects.MODELS_BUCKET, subjects.BATCHES_BUCKET, *TINKER_BUCKETS)),
    *(_object_stream(b) for b in (subjects.DATASETS_BUCKET, subjects.ADAPTERS_BUCKET,
                                  subjects.TINKER_BLOBS_BUCKET)),
)
# The durable consumers ensure_topology makes, so WORK is interesting to the ledger from the start.
TOPOLOGY_CONSUMERS = ((subjects.ADVISORIES_STREAM, subjects.DEAD_LETTERS_DURABLE),
                      (subjects.WORK_STREAM, subjects.LEDGER_WORK_DURABLE),
                      (subjects.RESULTS_STREAM, subjects.LEDGER_RESULTS_DURABLE))


def topology_creator() -> Permissions:
    """What bus.ensure_topology needs: create (never update, purge or delete) each stream, look it up,
    and create the ledger's and the dead letters' durable consumers."""
    publish = set()
    for stream in TOPOLOGY_STREAMS:
        publish |= {f"{JS_API}.STREAM.CREATE.{stream}", f"{JS_API}.STREAM.INFO.{stream}"}
    for stream, durable in TOPOLOGY_CONSUMERS:
        publish |= {f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}.>",
                    f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}"}
    return Permissions(publish=publish, subscribe={INBOXES})


def _every_service(service: str, status: str) -> Permissions:
    """What every service process does: ensure the topology, answer its $SRV status, and ping
    itself (deploy/docker/healthcheck.py runs in its container, with its credentials)."""
    return (topology_creator().merge(service_responder(status))
            .merge(service_caller(f"$SRV.PING.{service}", f"$SRV.PING.{service}.>")))


def _service_subjects(prefix: str) -> tuple[str, ...]:
    """The request-reply subjects subjects.py names ``SVC_<prefix>...``."""
    return tuple(value for name, value in vars(subjects).items() if name.startswith(f"SVC_{prefix}"))


def _all_tinker_records(write: bool) -> Permissions:
    """tinker_store.TinkerStore: every Tinker KV bucket, the blobs, the futures."""
    perms = Permissions()
    for bucket in TINKER_BUCKETS:
        perms = perms.merge(kv_writer(bucket) if write else kv_reader(bucket))
    perms = perms.merge(object_writer(subjects.TINKER_BLOBS_BUCKET))
    return perms.merge(stream_reader(subjects.TINKER_FUTURES_STREAM)).merge(
        publisher(subjects.TINKER_FUTURES_ALL)).merge(listener(subjects.TINKER_FUTURES_ALL))


# --- the roles -----------------------------------------------------------------------------------
def gateway() -> Permissions:
    """Publishes work, cancels and Tinker calls; hears answers, token streams and events; asks the
    queue and trainer services. Never publishes results, job events or checkpoints; purges nothing
    but its own object stores' replaced chunks."""
    return (_every_service(subjects.GATEWAY_SERVICE, subjects.SVC_GATEWAY_STATUS)
            .merge(publisher(subjects.WORK_ALL, subjects.cancel("*"), subjects.TINKER_CALLS_ALL))
            .merge(listener(subjects.gateway_answers("*"), subjects.RESULTS_ALL, subjects.token_stream("*"),
                            subjects.QUEUE_STATE))
            .merge(stream_reader(subjects.RESULTS_STREAM))
            .merge(stream_reader(subjects.EVENTS_STREAM))
            .merge(kv_reader(subjects.MODELS_BUCKET))
            .merge(kv_writer(subjects.BATCHES_BUCKET))
            .merge(object_writer(subjects.DATASETS_BUCKET))
            # Chunked uploads in progress: the gateway's own bucket, made and kept at its TTL by it.
            .merge(object_writer(subjects.UPLOADS_BUCKET))
            .merge(publisher(*(f"{JS_API}.STREAM.{verb}.{_object_stream(subjects.UPLOADS_BUCKET)}"
                               for verb in ("CREATE", "UPDATE"))))
            # Dashboard sessions (auth/ui_sessions.py): its own bucket too, at its session lifetime.
            .merge(kv_writer(subjects.UI_SESSIONS_BUCKET))
            .merge(publisher(*(f"{JS_API}.STREAM.{verb}.{_kv_stream(subjects.UI_SESSIONS_BUCKET)}"
                               for verb in ("CREATE", "UPDATE"))))
            .merge(_all_tinker_records(write=True))
            # A run's client posts its metrics (tinker/run_metrics.py): the one event it writes.
            .merge(publisher(subjects.session_event("*", "metrics")))
            # /v1/health pings every service, the dashboard asks every replica for its stats; the
            # ScalarLM and train routes call queue and trainer.
            .merge(service_caller("$SRV.PING.>", "$SRV.INFO.>", "$SRV.STATS.>", *_service_subjects(""))))


def queue() -> Permissions:
    """The ledger of WORK and RESULTS, dead letters, clear_queue (the one purge of WORK), admission
    state. It alone updates an existing stream's configuration (after an upgrade)."""
    perms = (_every_service(subjects.QUEUE_SERVICE, subjects.SVC_QUEUE_STATUS)
             .merge(service_responder(subjects.SVC_QUEUE_METRICS, subjects.SVC_QUEUE_CLEAR))
             .merge(stream_reader(subjects.WORK_STREAM))
             .merge(stream_reader(subjects.RESULTS_STREAM))
             .merge(stream_reader(subjects.ADVISORIES_STREAM))
             .merge(kv_reader(subjects.MODELS_BUCKET))
             .merge(publisher(subjects.RESULTS_ALL, subjects.QUEUE_STATE,
                              f"{JS_API}.STREAM.PURGE.{subjects.WORK_STREAM}",
                              f"{JS_API}.STREAM.MSG.DELETE.{subjects.WORK_STREAM}")))
    return perms.merge(publisher(*(f"{JS_API}.STREAM.UPDATE.{s}" for s in TOPOLOGY_STREAMS)))


def inference() -> Permissions:
    """Pulls its deployment's WORK, answers on RESULTS, the gateway's answers subject and token
    streams; announces itself in MODELS; reads checkpoints and adapters; says an adapter loaded.
    Never publishes job events, work or checkpoints."""
    return (_every_service(subjects.INFERENCE_SERVICE, subjects.SVC_INFERENCE_STATUS)
            .merge(stream_reader(subjects.WORK_STREAM))
            .merge(publisher(subjects.RESULTS_ALL, subjects.gateway_answers("*"), subjects.token_stream("*"),
                             subjects.adapter_event("*", "loaded")))
            .merge(listener(subjects.CANCELS))
            .merge(stream_reader(subjects.EVENTS_STREAM))  # adapter retirements, to unload them
            .merge(kv_writer(subjects.MODELS_BUCKET))
            .merge(stream_reader(subjects.CHECKPOINTS_STREAM))
            .merge(object_reader(subjects.ADAPTERS_BUCKET)))


def trainer() -> Permissions:
    """Job events (and their purge when a job is deleted), Tinker session workers placed and their
    calls failed when one dies; reads uploaded datasets."""
    return (_every_service(subjects.TRAINER_SERVICE, subjects.SVC_TRAINER_STATUS)
            .merge(service_responder(*_service_subjects("TRAINER_")))
            .merge(publisher(subjects.JOB_EVENTS_ALL, subjects.SESSION_EVENTS_ALL, subjects.TINKER_CALLS_ALL,
                             f"{JS_API}.STREAM.PURGE.{subjects.EVENTS_STREAM}"))
            .merge(stream_reader(subjects.EVENTS_STREAM))
            .merge(stream_reader(subjects.TINKER_CALLS_STREAM))
            .merge(object_reader(subjects.DATASETS_BUCKET))
            .merge(adapter_retirer())
            .merge(_all_tinker_records(write=True)))


def checkpoint_watcher() -> Permissions:
    """Announces checkpoints (its stream's one writer), stores adapters, rejects bad ones; keeps its
    cursor in a bucket of its own."""
    return (_every_service(subjects.CHECKPOINT_WATCHER_SERVICE, subjects.SVC_CHECKPOINT_WATCHER_STATUS)
            .merge(publisher(subjects.CHECKPOINTS_ALL, subjects.adapter_event("*", "rejected")))
            .merge(stream_reader(subjects.CHECKPOINTS_STREAM))
            .merge(object_writer(subjects.ADAPTERS_BUCKET))
            .merge(kv_writer(subjects.CHECKPOINT_CURSOR_BUCKET))
            .merge(adapter_retirer())
            .merge(publisher(f"{JS_API}.STREAM.CREATE.{_kv_stream(subjects.CHECKPOINT_CURSOR_BUCKET)}")))


def tinker_worker() -> Permissions:
    """A Tinker session worker (ml/, launched by the trainer): its calls, its futures and records,
    its session events; hears its saved checkpoints announced. No job events, no work, no results."""
    return (topology_creator()
            .merge(service_responder())
            .merge(stream_reader(subjects.TINKER_CALLS_STREAM))
            .merge(publisher(subjects.SESSION_EVENTS_ALL))
            .merge(_all_tinker_records(write=True))
            .merge(stream_reader(subjects.CHECKPOINTS_STREAM))
            .merge(listener(subjects.CHECKPOINTS_ALL, subjects.adapter_event("*", "rejected"))))


PERMISSIONS = {GATEWAY: gateway, QUEUE: queue, INFERENCE: inference, TRAINER: trainer,
               CHECKPOINT_WATCHER: checkpoint_watcher, TINKER_WORKER: tinker_worker}


def permissions(role: str) -> Permissions:
    try:
        return PERMISSIONS[role]()
    except KeyError:
        raise ValueError(f"no NATS role {role!r}; roles: {', '.join(ROLES)}") from None
