"""Each role's NATS credentials in a real nats-server running the generated config: what the role
does works, and what it must not do the server refuses (a ``Permissions Violation`` error to the
client, the message never stored, the JetStream API never answering)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import urllib.request

import nats
import pytest
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError

from loopline.common.contracts import subjects
from loopline.common.contracts.schemas import WorkItem
from loopline.common.local import launcher
from loopline.common.local.stack import LocalStack
from loopline.common.runtime import bus, nats_auth, nats_permissions as roles
from loopline.gateway.auth.ui_sessions import UiSessions

DEPLOYMENT = subjects.deployment_key("tiny")
REFUSED = (NatsTimeoutError, TimeoutError, NoRespondersError)


@pytest.fixture
def server(tmp_path):
    config, passwords = nats_auth.write_local_config(tmp_path)
    proc = launcher.start_nats(tmp_path / "nats", launcher.free_port(), launcher.free_port(),
                               tmp_path / "nats.log", config)
    try:
        yield proc, passwords
    finally:
        launcher.stop(proc)


class Client:
    """One role's connection, with the errors the server sent it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS

    async def connect(self, url: str) -> Client:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, connect_timeout=2)
        self.js = self.nc.jetstream(timeout=1.5)
        return self

    async def violations(self, subject: str) -> bool:
        """Whether the server refused ``subject`` to this client (its error arrives asynchronously)."""
        for _ in range(20):
            await self.nc.flush()
            # nats-py lower-cases the server's -ERR text.
            errors = [e.lower() for e in self.errors]
            if any("permissions violation" in e and subject.lower() in e for e in errors):
                return True
            await asyncio.sleep(0.05)
        return False


@contextlib.asynccontextmanager
async def connected(server):
    proc, passwords = server
    clients: dict[str, Client] = {}
    for role in roles.ROLES:
        clients[role] = await Client().connect(nats_auth.role_url(proc.info["url"], role, passwords[role]))
    try:
        yield clients
    finally:
        for client in clients.values():
            await client.nc.close()


def test_local_credentials_are_private_and_kept(tmp_path):
    _, first = nats_auth.write_local_config(tmp_path)
    _, again = nats_auth.write_local_config(tmp_path)
    assert first == again and set(first) == set(roles.ROLES)
    assert len(set(first.values())) == len(roles.ROLES)
    for name in ("passwords.json", "auth.conf"):
        assert stat.S_IMODE(os.stat(nats_auth.auth_dir(tmp_path) / name).st_mode) == 0o600


def test_urls_in_logs_hide_the_password():
    url = nats_auth.role_url("nats://nats:4222", "gateway", "s3cretpw")
    assert url == "nats://gateway:s3cretpw@nats:4222"
    assert nats_auth.masked(url) == "nats://gateway:***@nats:4222"
    assert nats_auth.masked("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


async def test_a_wrong_password_is_refused(server):
    proc, passwords = server
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(nats_auth.role_url(proc.info["url"], "gateway", passwords["queue"]),
                           allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)


async def test_every_role_creates_the_topology_and_does_its_work(server):
    async with connected(server) as c:
        # Every service ensures the topology at start, under its own credentials.
        for role in roles.ROLES:
            await bus.ensure_topology(c[role].js)
            assert not c[role].errors, (role, c[role].errors)
        # gateway -> WORK -> replica -> RESULTS (stored) and the gateway's answers subject.
        answers = await c[roles.GATEWAY].nc.subscribe(subjects.gateway_answers("gw1"))
        item = WorkItem(request_id="r1", group="g1", index=0, model="tiny", route="chat", body="{}",
                        reply_to=subjects.answer("gw1", "g1"))
        await bus.publish_durable(c[roles.GATEWAY].js, subjects.work(DEPLOYMENT),
                                  item.model_dump_json().encode(), msg_id="r1")
        replica = c[roles.INFERENCE]
        await bus.ensure_work_consumer(replica.js, DEPLOYMENT, ack_wait_s=5, max_deliver=3)
        pull = await replica.js.pull_subscribe_bind(subjects.inference_durable(DEPLOYMENT),
                                                    stream=subjects.WORK_STREAM)
        [msg] = await pull.fetch(1, timeout=3)
        assert WorkItem.model_validate_json(msg.data).reply_to == item.reply_to
        await replica.nc.publish(subjects.answer("gw1", "g1"), b"answer")
        await bus.publish_durable(replica.js, subjects.result("g1", 0), b"answer", msg_id="r1")
        await msg.ack_sync()
        assert (await answers.next_msg(timeout=3)).data == b"answer"
        stored = await c[roles.GATEWAY].js.get_last_msg(subjects.RESULTS_STREAM, subjects.result("g1", 0))
        assert stored.data == b"answer"
        # A replica announces its deployment; the gateway reads it.
        await (await replica.js.key_value(subjects.MODELS_BUCKET)).put(DEPLOYMENT, b"{}")
        models = await c[roles.GATEWAY].js.key_value(subjects.MODELS_BUCKET)
        assert (await models.get(DEPLOYMENT)).value == b"{}"
        # The trainer publishes job events; the gateway reads them.
        await bus.publish_durable(c[roles.TRAINER].js, subjects.job_event("h1", "queued"), b"{}",
                                  msg_id="h1.q")
        await c[roles.GATEWAY].js.get_last_msg(subjects.EVENTS_STREAM, subjects.job_event("h1", "queued"))
        # The gateway stores a dataset the trainer reads; the watcher an adapter a replica reads.
        for writer, reader, bucket in ((roles.GATEWAY, roles.TRAINER, subjects.DATASETS_BUCKET),
                                       (roles.CHECKPOINT_WATCHER, roles.INFERENCE, subjects.ADAPTERS_BUCKET)):
            await (await c[writer].js.object_store(bucket)).put("h1/1", b"bytes")
            assert (await (await c[reader].js.object_store(bucket)).get("h1/1")).data == b"bytes"
        # The gateway keeps the dashboard's sessions in its own bucket, made at its TTL by it.
        sessions = UiSessions(c[roles.GATEWAY].js, max_age_s=60)
        session = await sessions.open("0" * 64)
        assert await sessions.key_of(session.encode()) == "0" * 64
        await sessions.close(session.encode())
        assert await sessions.key_of(session.encode()) is None
        # The queue clears WORK; the trainer purges a deleted job's events.
        await c[roles.QUEUE].js.purge_stream(subjects.WORK_STREAM)
        await c[roles.TRAINER].js.purge_stream(subjects.EVENTS_STREAM, subject=subjects.job_events("h1"))
        # The gateway asks the queue service over request-reply; the answer gets back (allow_responses).
        async def answer(msg) -> None:
            await msg.respond(b"{}")

        await c[roles.QUEUE].nc.subscribe(subjects.SVC_QUEUE_METRICS, cb=answer)
        await c[roles.QUEUE].nc.flush()  # the server has the subscription before the request
        assert (await c[roles.GATEWAY].nc.request(subjects.SVC_QUEUE_METRICS, b"", timeout=3)).data == b"{}"
        for role in roles.ROLES:
            assert not c[role].errors, (role, c[role].errors)


# Tier: waits out each refused JetStream request's time-out, ~8 s.
@pytest.mark.slow
async def test_what_a_role_must_not_do_is_refused(server):
    async with connected(server) as c:
        await bus.ensure_topology(c[roles.QUEUE].js)
        await bus.publish_durable(c[roles.GATEWAY].js, subjects.work(DEPLOYMENT), b"{}", msg_id="w1")
        replica, gateway, worker = c[roles.INFERENCE], c[roles.GATEWAY], c[roles.TINKER_WORKER]

        # A replica cannot publish job events: refused, and nothing is stored.
        event = subjects.job_event("h1", "completed")
        with pytest.raises(REFUSED):
            await replica.js.publish(event, b"{}")
        assert await replica.violations(event)
        events = await c[roles.QUEUE].js.stream_info(subjects.EVENTS_STREAM)
        assert events.state.messages == 0

        # A gateway cannot purge or delete a stream: the API never answers, WORK keeps its message.
        for call, api in ((gateway.js.purge_stream, "STREAM.PURGE"),
                          (gateway.js.delete_stream, "STREAM.DELETE")):
            with pytest.raises(REFUSED):
                await call(subjects.WORK_STREAM)
            assert await gateway.violations(f"$JS.API.{api}.{subjects.WORK_STREAM}")
        assert (await c[roles.QUEUE].js.stream_info(subjects.WORK_STREAM)).state.messages == 1
        # Nor can it publish a result or a checkpoint announcement.
        for subject in (subjects.result("g1", 0), subjects.checkpoint_subject("tiny", "h1")):
            await gateway.nc.publish(subject, b"forged")
            assert await gateway.violations(subject)

        # Only the queue updates a stream's configuration.
        info = await c[roles.QUEUE].js.stream_info(subjects.WORK_STREAM)
        with pytest.raises(REFUSED):
            await replica.js.update_stream(info.config)
        assert await replica.violations(f"$JS.API.STREAM.UPDATE.{subjects.WORK_STREAM}")

        # A session worker (job code) cannot read the watcher's cursor bucket or the dashboard's
        # sessions, queue work, or listen to other clients' results.
        for bucket in (subjects.CHECKPOINT_CURSOR_BUCKET, subjects.UI_SESSIONS_BUCKET):
            with pytest.raises(REFUSED):
                await worker.js.key_value(bucket)
            assert await worker.violations(f"$JS.API.STREAM.INFO.KV_{bucket}")
        await worker.nc.publish(subjects.work(DEPLOYMENT), b"{}")
        assert await worker.violations(subjects.work(DEPLOYMENT))
        await worker.nc.subscribe(subjects.RESULTS_ALL)
        assert await worker.violations(subjects.RESULTS_ALL)

        # Nobody but the trainer answers the trainer's API.
        await replica.nc.subscribe(subjects.SVC_TRAINER_SUBMIT)
        assert await replica.violations(subjects.SVC_TRAINER_SUBMIT)


def test_only_the_roles_that_clear_or_delete_purge_a_stream():
    """WORK is purged by the queue alone (clear_queue), EVENTS and CHECKPOINTS by the trainer and the
    watcher (a deleted job retired), RESULTS by nobody; the gateway, replicas and session workers
    purge only their object stores' replaced chunks. No role deletes a stream."""
    purge = f"{roles.JS_API}.STREAM.PURGE."
    purged = {role: {s[len(purge):] for s in roles.permissions(role).publish if s.startswith(purge)}
              for role in roles.ROLES}
    assert {role for role, streams in purged.items() if subjects.WORK_STREAM in streams} == {roles.QUEUE}
    assert not any(subjects.RESULTS_STREAM in streams for streams in purged.values())
    for stream in (subjects.EVENTS_STREAM, subjects.CHECKPOINTS_STREAM):
        assert {role for role, streams in purged.items() if stream in streams} == {
            roles.TRAINER, roles.CHECKPOINT_WATCHER}
    for role in (roles.GATEWAY, roles.INFERENCE, roles.TINKER_WORKER):
        assert all(stream.startswith("OBJ_") for stream in purged[role]), role
    for role in roles.ROLES:
        assert not any(".STREAM.DELETE." in s for s in roles.permissions(role).publish), role
    with pytest.raises(ValueError, match="no NATS role"):
        roles.permissions("admin")


# Tier: a whole stack under NATS auth.
@pytest.mark.stack
def test_the_stack_serves_with_each_service_under_its_own_credentials(tmp_path):
    """The real services (queue, trainer, checkpoint-watcher, a replica, the gateway) with NATS
    authentication on, as compose and Helm run it: they start, answer a request, streamed and not,
    and the server refused them nothing; no log holds a password."""
    from support.stacks import MODELS_DIR, TEST_ENV, tiny_model

    stack = LocalStack(tmp_path, tiny_model(), env=TEST_ENV, models_dir=MODELS_DIR, nats_auth=True)
    stack.start()
    try:
        health = json.loads(urllib.request.urlopen(f"{stack.url}/v1/health", timeout=10).read())
        assert health["all"] == "up", health
        for stream in (False, True):
            body = {"model": stack.default_model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": stream}
            request = urllib.request.Request(f"{stack.url}/v1/chat/completions", json.dumps(body).encode(),
                                             {"content-type": "application/json"})
            answer = urllib.request.urlopen(request, timeout=120).read()
            assert b"chat.completion" in answer
        # The dashboard reads every replica's status over $SRV.STATS and follows EVENTS.
        page = urllib.request.urlopen(f"{stack.url}/ui", timeout=30).read().decode()
        assert 'data-replica="r0"' in page and '<td class="ok">up</td>' in page, page[:3000]
    finally:
        stack.stop()
    nats_log = (stack.logs / "nats.log").read_text()
    assert "authorization" not in nats_log.lower() and "violation" not in nats_log.lower(), nats_log[-3000:]
    passwords = nats_auth.local_passwords(nats_auth.auth_dir(tmp_path)).values()
    for log in stack.logs.glob("*.log"):
        text = log.read_text()
        assert not [p for p in passwords if p in text], f"{log.name} holds a NATS password"
