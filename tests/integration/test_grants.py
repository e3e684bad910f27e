"""Topic permissions (enforced as RabbitMQ enforces them), user limits and global parameters:
the API, AMQP and HTTP publishes and bindings, a restart, and a cluster leader's kill -9.

RabbitMQ's topic authorisation: on a topic exchange, a user with a topic permission there may
publish only with routing keys its ``write`` pattern matches and bind (or unbind) only with keys
its ``read`` pattern matches (403 ACCESS_REFUSED otherwise); ``{username}``/``{vhost}`` expand;
other exchanges and users without one are not affected.
"""

from __future__ import annotations

import time
from pathlib import Path

import pika
import pytest
from pamqp import commands

from ._raw import FRAME_BODY, FRAME_HEADER, RawConn, frame_bytes, method_bytes
from ._raw import header_payload as hp
from ._support import SkredProcess, is_external, unique, wait_until
from .test_cluster import Cluster, ClusterNode, start_cluster, wait_for
from .test_cluster import cluster as cluster  # noqa: F401 - the three-node cluster fixture
from .test_mgmt_api import Api, http_ready, q, start_mgmt_broker
from .test_mgmt_api import mb as mb  # noqa: F401 - a module's broker with the management API

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's management API on a known port")


def _user_with_topic_permission(api: Api, write: str = "^pub\\.", read: str = "^sub\\.") -> str:
    user = unique("tp")
    api.ok("PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": "management"})
    api.ok("PUT", f"/api/permissions/%2F/{q(user)}", {"configure": ".*", "write": ".*", "read": ".*"})
    api.ok("PUT", f"/api/topic-permissions/%2F/{q(user)}", {"exchange": "amq.topic", "write": write,
                                                             "read": read})
    return user


def _refused(fn: object, *args: object, **kw: object) -> int:
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        fn(*args, **kw)  # type: ignore[operator]
    return int(ei.value.reply_code)


def _amqp_checks(host: str, port: int, user: str) -> None:
    """What the user may do on amq.topic with ^pub\\. / ^sub\\. (the queue is its own)."""
    creds = pika.PlainCredentials(user, "pw")
    conn = pika.BlockingConnection(pika.ConnectionParameters(host, port, "/", creds))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        qn = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(qn, "amq.topic", "sub.#")
        ch.basic_publish("amq.topic", "pub.a", b"allowed")
        ch.basic_publish("amq.direct", "anything", b"other exchanges are not affected")
        assert _refused(ch.basic_publish, "amq.topic", "other.a", b"refused") == 403
        ch = conn.channel()
        assert _refused(ch.queue_bind, qn, "amq.topic", "other.#") == 403
        ch = conn.channel()
        assert _refused(ch.queue_unbind, qn, "amq.topic", "other.#") == 403
        ch = conn.channel()
        ch.exchange_declare(unique("x"), "fanout", auto_delete=True)
        assert _refused(ch.exchange_bind, "amq.fanout", "amq.topic", "other") == 403
    finally:
        conn.close()


def test_topic_permissions_enforced_over_amqp_and_http(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    user = _user_with_topic_permission(api)
    try:
        assert api.get(f"/api/topic-permissions/%2F/{q(user)}") == [
            {"user": user, "vhost": "/", "exchange": "amq.topic", "write": "^pub\\.", "read": "^sub\\."}]
        assert any(p["user"] == user for p in api.get("/api/topic-permissions"))
        assert [p["user"] for p in api.get(f"/api/users/{q(user)}/topic-permissions")] == [user]
        _amqp_checks(mb.host, mb.port, user)

        # the management API applies the same check to its publishes and bindings
        as_user = api.as_user(user, "pw")
        status, body, _ = as_user.call("POST", "/api/exchanges/%2F/amq.topic/publish", {
            "routing_key": "other", "payload": "x", "payload_encoding": "string", "properties": {}})
        assert status == 401, body
        status, body, _ = as_user.call("POST", "/api/exchanges/%2F/amq.topic/publish", {
            "routing_key": "pub.ok", "payload": "x", "payload_encoding": "string", "properties": {}})
        assert status == 200, body
        qn = unique("tq")
        as_user.ok("PUT", f"/api/queues/%2F/{q(qn)}", {"durable": False, "auto_delete": False})
        status, body, _ = as_user.call("POST", f"/api/bindings/%2F/e/amq.topic/q/{q(qn)}",
                                       {"routing_key": "other"})
        assert status == 401, body
        as_user.ok("POST", f"/api/bindings/%2F/e/amq.topic/q/{q(qn)}", {"routing_key": "sub.x"})
        api.ok("DELETE", f"/api/queues/%2F/{q(qn)}")

        # a bad regex is refused; deleting the permission lifts the restriction
        status, _, _ = api.call("PUT", f"/api/topic-permissions/%2F/{q(user)}",
                                {"exchange": "amq.topic", "write": "(", "read": ""})
        assert status == 400
        api.ok("DELETE", f"/api/topic-permissions/%2F/{q(user)}")
        assert api.call("GET", f"/api/topic-permissions/%2F/{q(user)}")[0] == 404
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            mb.host, mb.port, "/", pika.PlainCredentials(user, "pw")))
        conn.channel().basic_publish("amq.topic", "other.a", b"now allowed")
        conn.close()
    finally:
        api.ok("DELETE", f"/api/users/{q(user)}")


def test_permission_changes_apply_to_open_connections(mb: SkredProcess) -> None:
    """A permission or topic permission set while a connection is open applies to its next
    publish, though it published to that exchange before (the granted check was remembered)."""
    api = Api(mb.mgmt_port)
    user = unique("late")
    api.ok("PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": ""})
    api.ok("PUT", f"/api/permissions/%2F/{q(user)}", {"configure": ".*", "write": ".*", "read": ".*"})
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        mb.host, mb.port, "/", pika.PlainCredentials(user, "pw")))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("amq.topic", "other.1", b"allowed: no topic permission yet")
        ch.basic_publish("amq.direct", "k", b"allowed")
        api.ok("PUT", f"/api/topic-permissions/%2F/{q(user)}",
               {"exchange": "amq.topic", "write": "^pub\\.", "read": ""})
        assert _refused(ch.basic_publish, "amq.topic", "other.2", b"refused now") == 403
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("amq.topic", "pub.3", b"allowed")
        api.ok("PUT", f"/api/permissions/%2F/{q(user)}", {"configure": ".*", "write": "^amq\\.topic$",
                                                           "read": ".*"})
        assert _refused(ch.basic_publish, "amq.direct", "k", b"write revoked") == 403
    finally:
        if conn.is_open:
            conn.close()
        api.ok("DELETE", f"/api/users/{q(user)}")


def test_topic_permission_checks_every_publish_of_a_batch(mb: SkredProcess) -> None:
    """Publishes written in one read go through the batch path: each routing key is checked,
    and the refused one and everything after it on the channel reach no queue."""
    api = Api(mb.mgmt_port)
    user = _user_with_topic_permission(api, write="^{username}\\.")
    watcher = pika.BlockingConnection(pika.ConnectionParameters(mb.host, mb.port))
    try:
        wch = watcher.channel()
        qn = wch.queue_declare("", exclusive=True).method.queue
        wch.queue_bind(qn, "amq.topic", "#")
        with RawConn(mb.host, mb.port) as c:
            c.handshake(user=user, password="pw")
            c.open_channel(1)
            out = b""
            for key in (f"{user}.1", f"{user}.2", "someone-else.3", f"{user}.4"):
                body = key.encode()
                out += method_bytes(1, commands.Basic.Publish(exchange="amq.topic", routing_key=key))
                out += frame_bytes(FRAME_HEADER, 1, hp(len(body), commands.Basic.Properties()))
                out += frame_bytes(FRAME_BODY, 1, body)
            c.send(out)
            closed = c.expect(commands.Channel.Close, 1)
            assert closed.reply_code == 403 and "someone-else.3" in closed.reply_text, closed
        got: list[bytes] = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            m = wch.basic_get(qn, auto_ack=True)
            if m[0] is None:
                watcher.process_data_events(0.05)  # bounded poll for the two allowed ones
                continue
            got.append(m[2])
        watcher.process_data_events(0.3)
        assert got == [f"{user}.1".encode(), f"{user}.2".encode()]
        assert wch.basic_get(qn, auto_ack=True)[0] is None
    finally:
        watcher.close()
        api.ok("DELETE", f"/api/users/{q(user)}")


def test_user_limits_and_global_parameters_survive_a_restart(tmp_path: Path) -> None:
    b = start_mgmt_broker(tmp_path)
    try:
        api = Api(b.mgmt_port)
        user = _user_with_topic_permission(api)
        api.ok("PUT", f"/api/user-limits/{q(user)}/max-connections", {"value": 3})
        assert api.call("PUT", f"/api/user-limits/{q(user)}/max-bananas", {"value": 3})[0] == 400
        assert api.ok("PUT", "/api/global-parameters/region", {"value": {"name": "eu"}}) is None
        b.kill9()
        b.start()
        wait_until(lambda: http_ready(b.mgmt_port), 10, "management HTTP listener after kill -9")
        assert api.get("/api/user-limits") == [{"user": user, "value": {"max-connections": 3}}]
        assert api.get(f"/api/users/{q(user)}")["limits"] == {"max-connections": 3}
        assert api.get("/api/global-parameters/region") == {"name": "region", "value": {"name": "eu"}}
        assert [p["exchange"] for p in api.get(f"/api/topic-permissions/%2F/{q(user)}")] == ["amq.topic"]
        _amqp_checks(b.host, b.port, user)
        api.ok("DELETE", f"/api/user-limits/{q(user)}/max-connections")
        assert api.call("DELETE", f"/api/user-limits/{q(user)}/max-connections")[0] == 404
        api.ok("DELETE", "/api/global-parameters/region")
        assert api.call("GET", "/api/global-parameters/region")[0] == 404
    finally:
        b.close()


def test_user_limits_enforced(mb: SkredProcess) -> None:
    """As RabbitMQ: max-connections refuses connection.open, max-channels counts the user's
    channels across its connections; both 530 NOT_ALLOWED, -1 means no limit."""
    api = Api(mb.mgmt_port)
    user = _user_with_topic_permission(api)
    params = pika.ConnectionParameters(mb.host, mb.port, "/", pika.PlainCredentials(user, "pw"))
    api.ok("PUT", f"/api/user-limits/{q(user)}/max-connections", {"value": 1})
    api.ok("PUT", f"/api/user-limits/{q(user)}/max-channels", {"value": 2})
    first = pika.BlockingConnection(params)
    try:
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as refused:
            pika.BlockingConnection(params)
        assert "530" in str(refused.value) and "connection limit (1)" in str(refused.value)
        api.ok("PUT", f"/api/user-limits/{q(user)}/max-connections", {"value": -1})
        second = pika.BlockingConnection(params)
        first.channel()
        second.channel()
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as ei:
            first.channel()
        assert ei.value.reply_code == 530 and "user limit of (2)" in ei.value.reply_text
        assert second.is_open
        second.close()
    finally:
        if first.is_open:
            first.close()
        api.ok("DELETE", f"/api/users/{q(user)}")


@pytest.mark.timeout(120)
def test_grants_apply_through_a_follower_and_survive_leader_kill9(cluster: Cluster) -> None:
    leader, followers = start_cluster(cluster)
    api = Api(leader.mgmt_port)
    api.base = f"http://{leader.ip}:{leader.mgmt_port}"
    wait_until(lambda: http_ready_at(api), 20, "the leader's management API")
    user = _user_with_topic_permission(api)
    api.ok("PUT", f"/api/user-limits/{q(user)}/max-channels", {"value": 50})
    api.ok("PUT", "/api/global-parameters/region", {"value": "eu"})
    _amqp_checks(followers[0].ip, followers[0].port, user)  # proxied to the leader
    leader.kill9()

    def new_leader() -> ClusterNode | None:
        n = cluster.leader()
        return n if n is not None and n is not leader and n.answers() else None
    successor = wait_for(new_leader, 30, "a new leader serving clients")
    api.base = f"http://{successor.ip}:{successor.mgmt_port}"
    wait_until(lambda: http_ready_at(api), 20, "the new leader's management API")
    assert api.get(f"/api/user-limits/{q(user)}") == [{"user": user, "value": {"max-channels": 50}}]
    assert api.get("/api/global-parameters/region")["value"] == "eu"
    _amqp_checks(successor.ip, successor.port, user)


def http_ready_at(api: Api) -> bool:
    try:
        return api.call("GET", "/api/overview")[0] == 200
    except OSError:
        return False
