"""Management HTTP API against a real Skred process: endpoints, auth, errors, AMQP permissions.

``Api`` is a tiny urllib client (shared with the metrics, ctl and definitions tests);
``start_mgmt_broker`` starts a broker with its metrics port on a free port too and polls
the HTTP listener until it answers.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, connect, free_port, is_external, unique, wait_until

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's management API on a known port")


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class Api:
    def __init__(self, port: int, user: str = "guest", password: str = "guest") -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.user, self.password = user, password

    def as_user(self, user: str, password: str) -> Api:
        return Api(int(self.base.rsplit(":", 1)[1]), user, password)

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
             auth: bool = True) -> tuple[int, Any, dict[str, str]]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if auth:
            token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
            req.add_header("Authorization", "Basic " + token)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                status, text, headers = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            status, text, headers = exc.code, exc.read(), dict(exc.headers)
        try:
            parsed = json.loads(text) if text.strip() else None
        except ValueError:
            parsed = text.decode(errors="replace")
        return status, parsed, headers

    def get(self, path: str) -> Any:
        status, body, _ = self.call("GET", path)
        assert status == 200, (path, status, body)
        return body

    def ok(self, method: str, path: str, body: Any = None, expect: tuple[int, ...] = (201, 204)) -> Any:
        status, parsed, _ = self.call(method, path, body)
        assert status in expect, (method, path, status, parsed)
        return parsed


def http_ready(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
        return True
    except (urllib.error.URLError, OSError):
        return False


def start_mgmt_broker(tmp: Path, extra: list[str] | None = None) -> SkredProcess:
    args = ["--mgmt-metrics-port", str(free_port()), *(extra or [])]
    b = SkredProcess(tmp / f"data-{unique('m')[-8:]}", args)
    try:
        b.start()
        wait_until(lambda: http_ready(b.mgmt_port), 10, "management HTTP listener")
    except BaseException:
        b.close()
        raise
    return b


def metrics_port(b: SkredProcess) -> int:
    return int(b.extra_args[b.extra_args.index("--mgmt-metrics-port") + 1])


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("mgmt"))
    yield b
    b.close()


@pytest.fixture
def api(mb: SkredProcess) -> Api:
    return Api(mb.mgmt_port)


def assert_error(result: tuple[int, Any, dict[str, str]], status: int) -> dict[str, Any]:
    got, body, _ = result
    assert got == status, (got, body)
    assert isinstance(body, dict) and "error" in body and "reason" in body, body
    return body


# ---------------------------------------------------------------------- auth
def test_auth_required_and_tags(api: Api) -> None:
    status, body, headers = api.call("GET", "/api/overview", auth=False)
    assert status == 401 and body["error"] == "not_authorized"
    assert headers.get("WWW-Authenticate", "").startswith("Basic")
    assert_error(api.as_user("guest", "wrong").call("GET", "/api/overview"), 401)
    assert_error(api.as_user("nobody", "x").call("GET", "/api/whoami"), 401)
    name = unique("u")
    api.ok("PUT", f"/api/users/{q(name)}", {"password": "pw", "tags": ""})
    assert_error(api.as_user(name, "pw").call("GET", "/api/overview"), 401)  # no tags: no API
    api.ok("PUT", f"/api/users/{q(name)}", {"password": "pw", "tags": "management"})
    mgmt_user = api.as_user(name, "pw")
    assert mgmt_user.get("/api/whoami") == {"name": name, "tags": ["management"]}
    assert_error(mgmt_user.call("GET", "/api/users"), 401)  # refusal: 401
    assert_error(mgmt_user.call("PUT", "/api/vhosts/x"), 401)  # refusal: 401
    assert mgmt_user.get("/api/vhosts") == []  # no permissions anywhere yet
    api.ok("DELETE", f"/api/users/{q(name)}")
    assert_error(mgmt_user.call("GET", "/api/whoami"), 401)


def test_overview_nodes_aliveness(api: Api, mb: SkredProcess) -> None:
    ov = api.get("/api/overview")
    assert ov["product_name"] == "Skred"
    assert {"connections", "channels", "queues", "consumers", "exchanges"} <= set(ov["object_totals"])
    assert {lst["protocol"]: lst["port"] for lst in ov["listeners"]}["amqp"] == mb.port
    assert api.get("/api/whoami") == {"name": "guest", "tags": ["administrator"]}
    nodes = api.get("/api/nodes")
    assert len(nodes) == 1 and nodes[0]["running"] is True and nodes[0]["fd_used"] > 0
    assert api.get(f"/api/nodes/{q(nodes[0]['name'])}")["name"] == nodes[0]["name"]
    assert_error(api.call("GET", "/api/nodes/nope@nowhere"), 404)
    assert api.get("/api/aliveness-test/%2F") == {"status": "ok"}
    assert_error(api.call("GET", "/api/aliveness-test/no-such-vhost"), 404)
    assert_error(api.call("GET", "/api/no-such-endpoint"), 404)
    assert api.get("/api/healthchecks/node") == {"status": "ok"}
    assert api.get(f"/api/healthchecks/node/{q(nodes[0]['name'])}") == {"status": "ok"}
    assert_error(api.call("GET", "/api/healthchecks/node/nope@nowhere"), 404)
    # the aliveness test runs as the user: monitoring without access to the vhost is refused
    mon = unique("mon")
    api.ok("PUT", f"/api/users/{q(mon)}", {"password": "pw", "tags": "monitoring"})
    try:
        assert_error(api.as_user(mon, "pw").call("GET", "/api/aliveness-test/%2F"), 401)
        api.ok("PUT", f"/api/permissions/%2F/{q(mon)}", {"configure": "^$", "write": ".*", "read": ".*"})
        assert_error(api.as_user(mon, "pw").call("GET", "/api/aliveness-test/%2F"), 401)
        api.ok("PUT", f"/api/permissions/%2F/{q(mon)}", {"configure": ".*", "write": ".*", "read": ".*"})
        assert api.as_user(mon, "pw").get("/api/aliveness-test/%2F") == {"status": "ok"}
    finally:
        api.ok("DELETE", f"/api/users/{q(mon)}")


# ------------------------------------------------------------- queues, exchanges
def test_queue_lifecycle_publish_get_purge(api: Api) -> None:
    qn = unique("q")
    assert api.call("PUT", f"/api/queues/%2F/{q(qn)}", {"durable": True})[0] == 201
    assert api.call("PUT", f"/api/queues/%2F/{q(qn)}", {"durable": True})[0] == 204
    assert_error(api.call("PUT", f"/api/queues/%2F/{q(qn)}", {"durable": False}), 400)  # inequivalent
    info = api.get(f"/api/queues/%2F/{q(qn)}")
    assert (info["name"], info["vhost"], info["durable"], info["messages"]) == (qn, "/", True, 0)
    for i in range(3):
        routed = api.ok("POST", "/api/exchanges/%2F/amq.default/publish",
                        {"properties": {"delivery_mode": 2, "headers": {"n": i}}, "routing_key": qn,
                         "payload": f"m{i}", "payload_encoding": "string"}, expect=(200,))
        assert routed == {"routed": True}
    info = api.get(f"/api/queues/%2F/{q(qn)}")
    assert info["messages_ready"] == 3 and info["message_stats"]["publish"] == 3
    got = api.ok("POST", f"/api/queues/%2F/{q(qn)}/get",
                 {"count": 2, "ackmode": "ack_requeue_true", "encoding": "auto"}, expect=(200,))
    assert [m["payload"] for m in got] == ["m0", "m1"]
    assert [m["message_count"] for m in got] == [2, 1]  # as RabbitMQ: left after each one
    assert got[0]["properties"]["headers"] == {"n": 0} and got[0]["properties"]["delivery_mode"] == 2
    assert api.get(f"/api/queues/%2F/{q(qn)}")["messages_ready"] == 3  # requeued
    got = api.ok("POST", f"/api/queues/%2F/{q(qn)}/get",
                 {"count": 1, "ackmode": "ack_requeue_false", "encoding": "base64"}, expect=(200,))
    assert base64.b64decode(got[0]["payload"]) in (b"m0", b"m1", b"m2")
    assert api.get(f"/api/queues/%2F/{q(qn)}")["messages_ready"] == 2
    assert api.call("DELETE", f"/api/queues/%2F/{q(qn)}/contents")[0] == 204
    assert api.get(f"/api/queues/%2F/{q(qn)}")["messages_ready"] == 0
    assert any(x["name"] == qn for x in api.get("/api/queues"))
    assert any(x["name"] == qn for x in api.get("/api/queues/%2F"))
    assert api.call("DELETE", f"/api/queues/%2F/{q(qn)}")[0] == 204
    assert_error(api.call("GET", f"/api/queues/%2F/{q(qn)}"), 404)
    assert_error(api.call("DELETE", f"/api/queues/%2F/{q(qn)}"), 404)


def test_exchanges_and_bindings(api: Api, mb: SkredProcess) -> None:
    ex, ex2, qn = unique("x"), unique("x"), unique("q")
    assert api.call("PUT", f"/api/exchanges/%2F/{q(ex)}", {"type": "topic", "durable": True})[0] == 201
    assert api.call("PUT", f"/api/exchanges/%2F/{q(ex2)}", {"type": "fanout"})[0] == 201
    assert api.get(f"/api/exchanges/%2F/{q(ex)}")["type"] == "topic"
    assert api.get("/api/exchanges/%2F/amq.default")["name"] == ""
    api.ok("PUT", f"/api/queues/%2F/{q(qn)}", {})
    status, _, headers = api.call("POST", f"/api/bindings/%2F/e/{q(ex)}/q/{q(qn)}",
                                  {"routing_key": "a.*", "arguments": {}})
    assert status == 201
    [qbind] = api.get(f"/api/bindings/%2F/e/{q(ex)}/q/{q(qn)}")
    assert qbind["routing_key"] == "a.*" and headers.get("Location") == qbind["properties_key"]
    api.ok("POST", f"/api/bindings/%2F/e/{q(ex)}/e/{q(ex2)}", {"routing_key": "b.#"})
    api.ok("POST", f"/api/bindings/%2F/e/{q(ex2)}/q/{q(qn)}", {})
    src = api.get(f"/api/exchanges/%2F/{q(ex)}/bindings/source")
    assert {(b["destination"], b["destination_type"], b["routing_key"]) for b in src} == {
        (qn, "queue", "a.*"), (ex2, "exchange", "b.#")}
    assert [b["source"] for b in api.get(f"/api/exchanges/%2F/{q(ex2)}/bindings/destination")] == [ex]
    qb = api.get(f"/api/queues/%2F/{q(qn)}/bindings")
    assert {b["source"] for b in qb} == {"", ex, ex2}  # the default exchange binding is listed too
    assert len(api.get(f"/api/bindings/%2F/e/{q(ex)}/q/{q(qn)}")) == 1
    publish = {"properties": {}, "payload": "x", "payload_encoding": "string"}
    assert api.ok("POST", f"/api/exchanges/%2F/{q(ex)}/publish", {**publish, "routing_key": "a.b"},
                  expect=(200,)) == {"routed": True}
    assert api.ok("POST", f"/api/exchanges/%2F/{q(ex)}/publish", {**publish, "routing_key": "b.c.d"},
                  expect=(200,)) == {"routed": True}
    assert api.ok("POST", f"/api/exchanges/%2F/{q(ex)}/publish", {**publish, "routing_key": "zzz"},
                  expect=(200,)) == {"routed": False}
    assert api.get(f"/api/queues/%2F/{q(qn)}")["messages_ready"] == 2
    # the same topology as seen over AMQP: a message routed through both exchanges arrives
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.basic_publish(ex, "b.zz", b"amqp")
        wait_until(lambda: api.get(f"/api/queues/%2F/{q(qn)}")["messages_ready"] == 3, 5, "amqp publish")
    finally:
        conn.close()
    key = q(qbind["properties_key"])
    assert api.get(f"/api/bindings/%2F/e/{q(ex)}/q/{q(qn)}/{key}")["routing_key"] == "a.*"
    assert api.call("DELETE", f"/api/bindings/%2F/e/{q(ex)}/q/{q(qn)}/{key}")[0] == 204
    assert_error(api.call("DELETE", f"/api/bindings/%2F/e/{q(ex)}/q/{q(qn)}/{key}"), 404)
    assert api.ok("POST", f"/api/exchanges/%2F/{q(ex)}/publish", {**publish, "routing_key": "a.b"},
                  expect=(200,)) == {"routed": False}
    assert_error(api.call("DELETE", "/api/exchanges/%2F/amq.direct"), 401)  # refusal: 401
    assert api.call("DELETE", f"/api/exchanges/%2F/{q(ex)}")[0] == 204
    assert_error(api.call("GET", f"/api/exchanges/%2F/{q(ex)}"), 404)
    api.ok("DELETE", f"/api/exchanges/%2F/{q(ex2)}")
    api.ok("DELETE", f"/api/queues/%2F/{q(qn)}")


# ------------------------------------------------- connections, channels, consumers
def test_connections_channels_consumers_and_close(api: Api, mb: SkredProcess) -> None:
    qn = unique("q")
    conn = connect(mb, client_properties={"connection_name": "mgmt-test"})
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=7)
        ch.queue_declare(qn, auto_delete=True)
        tag = ch.basic_consume(qn, lambda *a: None)
        wait_until(lambda: any(c["client_properties"].get("connection_name") == "mgmt-test"
                               for c in api.get("/api/connections")), 5, "connection listed")
        mine = next(c for c in api.get("/api/connections")
                    if c["client_properties"].get("connection_name") == "mgmt-test")
        assert mine["user"] == "guest" and mine["vhost"] == "/" and mine["channels"] == 1
        assert api.get(f"/api/connections/{q(mine['name'])}")["peer_port"] == mine["peer_port"]
        chans = api.get(f"/api/connections/{q(mine['name'])}/channels")
        assert len(chans) == 1 and chans[0]["prefetch_count"] == 7 and chans[0]["consumer_count"] == 1
        assert any(c["name"] == chans[0]["name"] for c in api.get("/api/channels"))
        assert api.get(f"/api/channels/{q(chans[0]['name'])}")["number"] == chans[0]["number"]
        cons = [c for c in api.get("/api/consumers") if c["queue"]["name"] == qn]
        assert len(cons) == 1 and cons[0]["consumer_tag"] == tag and cons[0]["ack_required"] is True
        assert api.get(f"/api/queues/%2F/{q(qn)}")["consumers"] == 1
        assert api.call("DELETE", f"/api/connections/{q(mine['name'])}")[0] == 204
        with pytest.raises(pika.exceptions.ConnectionClosed) as ei:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                conn.process_data_events(0.05)
        assert "320" in str(ei.value) or "CONNECTION_FORCED" in str(ei.value)
        wait_until(lambda: api.call("GET", f"/api/connections/{q(mine['name'])}")[0] == 404, 5,
                   "connection gone")
    finally:
        if conn.is_open:
            conn.close()
    assert_error(api.call("DELETE", "/api/connections/no-such-connection"), 404)


def test_channel_message_stats_split_deliver_get(api: Api, mb: SkredProcess) -> None:
    """A channel's ``deliver_get`` split as RabbitMQ's ``message_stats``: deliver (manual ack),
    deliver_no_ack, get, get_no_ack and redeliver, exact after a known sequence, on the list,
    the channel itself and its history."""
    q_get, q_cons, q_auto = unique("split-get"), unique("split-cons"), unique("split-auto")
    conn = connect(mb, client_properties={"connection_name": "split-test"})
    try:
        ch = conn.channel()
        for qn, n in ((q_get, 3), (q_cons, 2), (q_auto, 3)):
            ch.queue_declare(qn, auto_delete=False)
            for i in range(n):
                ch.basic_publish("", qn, b"m%d" % i)
        # gets: two with acks (one acked, one requeued), then one without, which is the requeued one
        m1, _, _ = ch.basic_get(q_get)
        m2, _, _ = ch.basic_get(q_get)
        assert m1 is not None and m2 is not None
        ch.basic_ack(m1.delivery_tag)
        ch.basic_nack(m2.delivery_tag, requeue=True)
        m3, _, _ = ch.basic_get(q_get, auto_ack=True)
        assert m3 is not None and m3.redelivered
        # a manual-ack consumer: two deliveries, one requeued and delivered again, all acked at last
        seen: list[Any] = []
        tag = ch.basic_consume(q_cons, lambda c, m, p, b: seen.append(m))
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            conn.process_data_events(0.05)
        ch.basic_nack(seen[0].delivery_tag, requeue=True)
        while len(seen) < 3 and time.monotonic() < deadline:
            conn.process_data_events(0.05)
        assert len(seen) == 3 and seen[2].redelivered
        ch.basic_ack(seen[1].delivery_tag)
        ch.basic_ack(seen[2].delivery_tag)
        ch.basic_cancel(tag)
        # an auto-ack consumer: three deliveries
        auto: list[Any] = []
        ch.basic_consume(q_auto, lambda c, m, p, b: auto.append(m), auto_ack=True)
        while len(auto) < 3 and time.monotonic() < deadline:
            conn.process_data_events(0.05)
        assert len(auto) == 3
        want = {"publish": 8, "deliver": 3, "deliver_no_ack": 3, "get": 2, "get_no_ack": 1, "redeliver": 2,
                "deliver_get": 9, "ack": 3}
        mine = next(c for c in api.get("/api/connections")
                    if c["client_properties"].get("connection_name") == "split-test")
        listed = api.get(f"/api/connections/{q(mine['name'])}/channels")[0]
        name = listed["name"]

        def counts(stats: dict[str, Any]) -> dict[str, Any]:
            return {k: stats.get(k) for k in want}

        assert counts(listed["message_stats"]) == want
        assert counts(next(c for c in api.get("/api/channels") if c["name"] == name)["message_stats"]) == want
        one = api.get(f"/api/channels/{q(name)}?msg_rates_age=60&msg_rates_incr=5")
        assert counts(one["message_stats"]) == want
        for k in want:
            assert "rate" in one["message_stats"][f"{k}_details"], k
        # the history holds the split too (samples appear once the sampler recorded the channel)
        wait_until(lambda: "samples" in api.get(f"/api/channels/{q(name)}?msg_rates_age=60&msg_rates_incr=5")
                   ["message_stats"]["deliver_no_ack_details"], 15, "deliver_no_ack history")
        hist = api.get(f"/api/channels/{q(name)}?msg_rates_age=60&msg_rates_incr=5")["message_stats"]
        assert hist["get_no_ack_details"]["samples"][0]["sample"] == 1
    finally:
        if conn.is_open:
            for qn in (q_get, q_cons, q_auto):
                conn.channel().queue_delete(qn)
            conn.close()


# ------------------------------------------- vhosts, users, permissions (+ AMQP)
def test_vhosts_users_permissions_enforced_on_amqp(api: Api, mb: SkredProcess) -> None:
    vh, user = unique("vh"), unique("u")
    assert api.call("PUT", f"/api/vhosts/{q(vh)}")[0] == 201
    assert api.call("PUT", f"/api/vhosts/{q(vh)}")[0] == 204
    assert any(v["name"] == vh for v in api.get("/api/vhosts"))
    assert api.call("PUT", f"/api/users/{q(user)}", {"password": "s3cret", "tags": ["management"]})[0] == 201
    assert api.get(f"/api/users/{q(user)}")["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    params = pika.ConnectionParameters("127.0.0.1", mb.port, vh, pika.PlainCredentials(user, "s3cret"),
                                       socket_timeout=5, connection_attempts=1)
    # no permissions on the vhost: connection.open refused with 530 NOT_ALLOWED
    with pytest.raises(pika.exceptions.AMQPConnectionError) as ei:
        pika.BlockingConnection(params)
    assert "530" in repr(ei.value) or "NOT_ALLOWED" in repr(ei.value)
    assert api.call("PUT", f"/api/permissions/{q(vh)}/{q(user)}",
                    {"configure": "^mine\\..*", "write": "^mine\\..*", "read": "^mine\\..*"})[0] == 201
    assert api.get(f"/api/permissions/{q(vh)}/{q(user)}")["configure"] == "^mine\\..*"
    assert any(p["user"] == user for p in api.get(f"/api/vhosts/{q(vh)}/permissions"))
    assert any(p["vhost"] == vh for p in api.get(f"/api/users/{q(user)}/permissions"))
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        ch.queue_declare("mine.q")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ce:
            ch.queue_declare("other.q")
        assert ce.value.reply_code == 403
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ce:
            ch.basic_consume("amq.gen-nope", lambda *a: None)
            conn.process_data_events(0.5)
        assert ce.value.reply_code in (403, 404)
    finally:
        if conn.is_open:
            conn.close()
    # the management user sees only its vhost, and objects there
    restricted = api.as_user(user, "s3cret")
    assert [v["name"] for v in restricted.get("/api/vhosts")] == [vh]
    assert [x["name"] for x in restricted.get("/api/queues")] == ["mine.q"]
    assert_error(restricted.call("PUT", f"/api/queues/{q(vh)}/other.q", {}), 401)  # refusal: 401
    assert restricted.call("PUT", f"/api/queues/{q(vh)}/mine.api", {})[0] == 201
    assert_error(restricted.call("GET", "/api/queues/%2F"), 401)  # vhost refused, as RabbitMQ
    assert api.call("DELETE", f"/api/permissions/{q(vh)}/{q(user)}")[0] == 204
    assert_error(api.call("GET", f"/api/permissions/{q(vh)}/{q(user)}"), 404)
    assert api.call("DELETE", f"/api/vhosts/{q(vh)}")[0] == 204
    assert_error(api.call("GET", f"/api/vhosts/{q(vh)}"), 404)
    assert not any(p["vhost"] == vh for p in api.get("/api/permissions"))
    api.ok("DELETE", f"/api/users/{q(user)}")
    assert_error(api.call("GET", f"/api/users/{q(user)}"), 404)


def test_user_with_password_hash_can_log_in(api: Api, mb: SkredProcess) -> None:
    # A RabbitMQ-style hash: base64(salt || sha256(salt || password)).
    import hashlib

    salt = b"\x01\x02\x03\x04"
    pw_hash = base64.b64encode(salt + hashlib.sha256(salt + b"hashed-pw").digest()).decode()
    user = unique("u")
    api.ok("PUT", f"/api/users/{q(user)}", {"password_hash": pw_hash, "tags": "monitoring"})
    assert api.get(f"/api/users/{q(user)}")["password_hash"] == pw_hash
    assert api.as_user(user, "hashed-pw").get("/api/whoami")["tags"] == ["monitoring"]
    assert_error(api.as_user(user, "other").call("GET", "/api/whoami"), 401)
    api.ok("DELETE", f"/api/users/{q(user)}")


# ------------------------------------------------------------------ bad input
def test_bad_input_gets_4xx_and_changes_nothing(api: Api) -> None:
    before_q = {x["name"] for x in api.get("/api/queues")}
    before_users = {u["name"] for u in api.get("/api/users")}
    qn = unique("q")
    assert_error(api.call("PUT", f"/api/queues/%2F/{q(qn)}", raw=b"{not json"), 400)
    assert_error(api.call("PUT", f"/api/queues/%2F/{q(qn)}", raw=b"[1, 2]"), 400)
    assert_error(api.call("PUT", f"/api/queues/%2F/{q(qn)}", {"durable": "maybe"}), 400)
    assert_error(api.call("PUT", f"/api/queues/%2F/{q(qn)}", {"arguments": {"x-queue-type": "bogus"}}), 400)
    assert_error(api.call("PUT", f"/api/queues/%2F/{q(qn)}", {"arguments": [1]}), 400)
    assert_error(api.call("PUT", f"/api/queues/%2F/{'q' * 256}", {}), 400)
    assert_error(api.call("PUT", f"/api/queues/%2F/{q('../../etc')}", {}), 400)
    assert_error(api.call("PUT", f"/api/vhosts/{q('../x')}"), 400)
    assert_error(api.call("PUT", f"/api/queues/{q('no-such-vhost')}/{q(qn)}", {}), 404)
    assert_error(api.call("PUT", f"/api/exchanges/%2F/{q(qn)}", {"type": "bogus"}), 400)
    assert_error(api.call("PUT", f"/api/exchanges/%2F/{q(qn)}", {}), 400)  # type is required
    assert_error(api.call("PUT", "/api/exchanges/%2F/amq.newthing", {"type": "direct"}), 401)  # refusal: 401
    assert_error(api.call("POST", "/api/exchanges/%2F/amq.default/publish",
                          {"routing_key": "x", "payload": "x"}), 400)  # missing fields
    assert_error(api.call("POST", "/api/exchanges/%2F/amq.default/publish",
                          {"properties": {"bogus": 1}, "routing_key": "x", "payload": "x",
                           "payload_encoding": "string"}), 400)
    assert_error(api.call("POST", "/api/exchanges/%2F/amq.default/publish",
                          {"properties": {}, "routing_key": "x", "payload": "!!",
                           "payload_encoding": "base64"}), 400)
    assert_error(api.call("PUT", f"/api/users/{q(qn)}", {"tags": "management"}), 400)  # no password
    assert_error(api.call("PUT", f"/api/users/{q(qn)}", {"password": 5}), 400)
    assert_error(api.call("PUT", f"/api/users/{q(qn)}", {"password": "x", "password_hash": "y"}), 400)
    assert_error(api.call("PUT", "/api/permissions/%2F/guest", {"configure": ".*"}), 400)
    assert_error(api.call("PUT", "/api/permissions/%2F/guest",
                          {"configure": "(", "write": ".*", "read": ".*"}), 400)
    assert_error(api.call("PUT", "/api/permissions/%2F/no-such-user",  # RabbitMQ: 400, not 404
                          {"configure": ".*", "write": ".*", "read": ".*"}), 400)
    # the only administrator can be neither deleted nor demoted
    assert_error(api.call("DELETE", "/api/users/guest"), 400)
    assert_error(api.call("PUT", "/api/users/guest", {"password": "guest", "tags": "management"}), 400)
    assert api.get("/api/whoami")["tags"] == ["administrator"]
    assert_error(api.call("GET", "/api/queues?page=0"), 400)
    assert_error(api.call("GET", "/api/queues?page=1&page_size=501"), 400)
    assert_error(api.call("PATCH", "/api/overview"), 405)
    assert {x["name"] for x in api.get("/api/queues")} == before_q
    assert {u["name"] for u in api.get("/api/users")} == before_users
    assert api.get("/api/permissions/%2F/guest")["configure"] == ".*"


def test_pagination_filter_sort(api: Api) -> None:
    prefix = unique("page")
    names = [f"{prefix}.{i:02d}" for i in range(7)]
    for n in names:
        api.ok("PUT", f"/api/queues/%2F/{q(n)}", {"durable": False})
    try:
        page = api.get(f"/api/queues?page=2&page_size=3&name={q(prefix)}&sort=name")
        assert page["filtered_count"] == 7 and page["page_count"] == 3 and page["page"] == 2
        assert [i["name"] for i in page["items"]] == names[3:6]
        assert page["total_count"] >= 7 and page["item_count"] == 3
        rev = api.get(f"/api/queues/%2F?name={q(prefix)}&sort=name&sort_reverse=true")
        assert [i["name"] for i in rev] == names[::-1]
        cols = api.get(f"/api/queues?name={q(prefix)}&columns=name,vhost&sort=name")
        assert cols[0] == {"name": names[0], "vhost": "/"}
        rx = api.get(f"/api/queues?page=1&name={q(prefix + '.0[12]')}&use_regex=true")
        assert [i["name"] for i in rx["items"]] == names[1:3]
    finally:
        for n in names:
            api.call("DELETE", f"/api/queues/%2F/{q(n)}")


def test_policies_stored_and_shown(api: Api) -> None:
    name = unique("pol")
    body = {"pattern": "^ha\\.", "definition": {"max-length": 10}, "priority": 1, "apply-to": "queues"}
    assert api.call("PUT", f"/api/policies/%2F/{q(name)}", body)[0] == 201
    got = api.get(f"/api/policies/%2F/{q(name)}")
    assert (got["pattern"], got["definition"], got["priority"], got["apply-to"]) == (
        "^ha\\.", {"max-length": 10}, 1, "queues")
    assert any(p["name"] == name for p in api.get("/api/policies"))
    assert any(p["name"] == name for p in api.get("/api/policies/%2F"))
    assert_error(api.call("PUT", f"/api/policies/%2F/{q(name)}", {**body, "pattern": "("}), 400)
    assert_error(api.call("PUT", f"/api/policies/%2F/{q(name)}", {**body, "apply-to": "x"}), 400)
    assert_error(api.call("PUT", f"/api/policies/%2F/{q(name)}", {"pattern": "x"}), 400)
    assert api.get(f"/api/policies/%2F/{q(name)}")["pattern"] == "^ha\\."  # unchanged
    assert api.call("DELETE", f"/api/policies/%2F/{q(name)}")[0] == 204
    assert_error(api.call("GET", f"/api/policies/%2F/{q(name)}"), 404)


@pytest.mark.timeout(40)
def test_message_rates_move(api: Api, mb: SkredProcess) -> None:
    qn = unique("q")
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(qn, auto_delete=False)
        for _ in range(50):
            ch.basic_publish("", qn, b"r")
        wait_until(lambda: api.get(f"/api/queues/%2F/{q(qn)}")["message_stats"]["publish"] == 50, 5,
                   "publish counter")

        def rate_seen() -> bool:
            info = api.get(f"/api/queues/%2F/{q(qn)}")
            ov = api.get("/api/overview")
            return bool(info["message_stats"]["publish_details"]["rate"] > 0
                        and ov["message_stats"]["publish_details"]["rate"] > 0)

        wait_until(rate_seen, 15, "a non-zero publish rate (sampled every 5 s)")
        ch.queue_delete(qn)
    finally:
        conn.close()


def test_many_requests_keep_broker_healthy(api: Api) -> None:
    calls: list[Callable[[], Any]] = [lambda: api.get("/api/overview"), lambda: api.get("/api/queues")]
    for i in range(40):
        calls[i % 2]()
    assert api.get("/api/aliveness-test/%2F") == {"status": "ok"}
