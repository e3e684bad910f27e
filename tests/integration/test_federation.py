"""Exchange and queue federation between real Skred brokers over real sockets.

One broker per module (the shared broker; in the cluster modes the session cluster's leader or a
follower, whose client ports proxy to the leader that runs the links). Each test makes vhosts of
its own and points upstreams at another vhost of the same broker through its AMQP port: a link is
a real AMQP connection either way, and a vhost of a cluster is identified in ``x-received-from``
by its cluster name and vhost, so vhosts stand in for brokers (cycles and chains included).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import pika
import pytest

from ._relay import Relay
from ._support import Broker, unique, wait_until
from .test_mgmt_api import Api
from .test_rabbitmqadmin import ADMIN, admin, ok

SINGLE = pytest.mark.parametrize("broker_mode", ["single"], indirect=True, scope="module")  # the same broker
LINK_DEADLINE = 20.0  # a link connects, declares and binds in well under a second on a quiet machine


def api_of(b: Broker) -> Api:
    api = Api(b.mgmt_port)
    api.base = f"http://{b.host}:{b.mgmt_port}"  # a cluster's nodes have addresses of their own
    return api


def vhosts(api: Api, n: int) -> list[str]:
    names = [unique("fedvh") for _ in range(n)]
    for v in names:
        assert api.call("PUT", f"/api/vhosts/{v}")[0] in (201, 204)
        assert api.call("PUT", f"/api/permissions/{v}/guest",
                        {"configure": ".*", "write": ".*", "read": ".*"})[0] in (201, 204)
    return names


def drop_vhosts(api: Api, names: list[str]) -> None:
    for v in names:
        api.call("DELETE", f"/api/vhosts/{v}")


def conn(b: Broker, vhost: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(
        f"amqp://guest:guest@{b.host}:{b.port}/{quote(vhost, safe='')}"))


def upstream(api: Api, b: Broker, down: str, name: str, up: str, **extra: Any) -> None:
    value = {"uri": f"amqp://guest:guest@{b.host}:{b.port}/{quote(up, safe='')}", "reconnect-delay": 1,
             **extra}
    status, body, _ = api.call("PUT", f"/api/parameters/federation-upstream/{quote(down, safe='')}/{name}",
                               {"value": value})
    assert status in (201, 204), body


def policy(api: Api, vhost: str, definition: dict[str, Any], pattern: str = "^fed\\.",
           apply_to: str = "all") -> None:
    status, body, _ = api.call("PUT", f"/api/policies/{quote(vhost, safe='')}/federate",
                               {"pattern": pattern, "definition": definition, "apply-to": apply_to})
    assert status in (201, 204), body


def links(api: Api, vhost: str) -> list[dict[str, Any]]:
    status, body, _ = api.call("GET", f"/api/federation-links/{quote(vhost, safe='')}")
    assert status == 200, body
    return list(body)


def wait_running(api: Api, vhost: str, n: int) -> list[dict[str, Any]]:
    wait_until(lambda: sum(lk["status"] == "running" for lk in links(api, vhost)) >= n, LINK_DEADLINE,
               f"{n} federation link(s) running in {vhost}")
    return links(api, vhost)


def upstream_bound(api: Api, vhost: str, exchange: str, key: str) -> bool:
    _, found, _ = api.call("GET", f"/api/exchanges/{quote(vhost, safe='')}/{exchange}/bindings/source")
    return any(bd["routing_key"] == key and bd["destination"].startswith("federation: ") for bd in found)


def count(ch: Any, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


def consume_n(c: pika.BlockingConnection, ch: Any, queue: str, n: int, prefetch: int) -> list[bytes]:
    """Consume (manual acks, ``prefetch``) until ``n`` messages arrived or the deadline passed."""
    bodies: list[bytes] = []
    ch.basic_qos(prefetch_count=prefetch)
    ch.basic_consume(queue, lambda chan, m, _p, body: (bodies.append(body), chan.basic_ack(m.delivery_tag)))
    deadline = time.monotonic() + LINK_DEADLINE
    while len(bodies) < n and time.monotonic() < deadline:
        c.process_data_events(0.05)
    return bodies


def drain(ch: Any, queue: str) -> list[tuple[bytes, Any]]:
    out = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append((body, props))


# ---------------------------------------------------------------- parameters
BAD_UPSTREAMS = [
    ({"uri": "http://example"}, "scheme"),
    ({"uri": "amqp://h", "no-such-key": 1}, "unknown key"),
    ({"uri": "amqp://h", "prefetch-count": 0}, "prefetch-count"),
    ({"uri": "amqp://h", "ack-mode": "sometimes"}, "ack-mode"),
    ({"uri": "amqp://h", "max-hops": "2"}, "max-hops"),
    ({"uri": []}, "uri"),
    ({"prefetch-count": 10}, "uri"),
    ("amqp://h", "object"),
    ({"uri": "amqp://h:notaport"}, "bad URI"),
    ({"uri": "amqp:/%2Fguest:guest@127.0.0.1:5672/"}, "scheme"),
    ({"uri": "amqps:///vhost"}, "needs a host"),
]


@pytest.mark.cluster_modes
def test_upstream_parameters_validated_stored_and_exported(shared_broker: Broker) -> None:
    api = api_of(shared_broker)
    [vh] = vhosts(api, 1)
    v = quote(vh, safe="")
    try:
        for value, word in BAD_UPSTREAMS:
            status, body, _ = api.call("PUT", f"/api/parameters/federation-upstream/{v}/bad",
                                       {"value": value})
            assert status == 400 and word in body["reason"], (value, status, body)
        status, body, _ = api.call("PUT", f"/api/parameters/federation-upstream-set/{v}/s",
                                   {"value": [{"prefetch-count": 1}]})
        assert status == 400 and "upstream" in body["reason"], body
        value = {"uri": ["amqp://u:secret@127.0.0.1:1/x", "amqps://h"], "max-hops": 2, "expires": 60000}
        assert api.call("PUT", f"/api/parameters/federation-upstream/{v}/up1", {"value": value})[0] == 201
        assert api.call("PUT", f"/api/parameters/federation-upstream/{v}/up1", {"value": value})[0] == 204
        assert api.call("PUT", f"/api/parameters/federation-upstream-set/{v}/s",
                        {"value": [{"upstream": "up1"}]})[0] == 201
        status, got, _ = api.call("GET", f"/api/parameters/federation-upstream/{v}/up1")
        assert status == 200 and got == {"name": "up1", "vhost": vh, "component": "federation-upstream",
                                         "value": value}
        sets = api.call("GET", f"/api/parameters/federation-upstream-set/{v}")[1]
        assert [p["name"] for p in sets] == ["s"]
        _, doc, _ = api.call("GET", "/api/definitions")
        mine = sorted((p["component"], p["name"]) for p in doc["parameters"] if p["vhost"] == vh)
        assert mine == [("federation-upstream", "up1"), ("federation-upstream-set", "s")]
        # a definitions import with a bad upstream changes nothing and names the entry
        bad = {"parameters": [{"vhost": vh, "component": "federation-upstream", "name": "x",
                               "value": {"uri": "ftp://x"}}]}
        status, body, _ = api.call("POST", "/api/definitions", bad)
        assert status == 400 and "parameters[0]" in str(body), body
        assert api.call("DELETE", f"/api/parameters/federation-upstream/{v}/up1")[0] == 204
        assert api.call("GET", f"/api/parameters/federation-upstream/{v}/up1")[0] == 404
        assert api.call("DELETE", f"/api/parameters/federation-upstream/{v}/up1")[0] == 404
        # re-import the exported upstream: it is back
        again = {"parameters": [p for p in doc["parameters"] if p["vhost"] == vh]}
        assert api.call("POST", "/api/definitions", again)[0] in (200, 201, 204)
        assert api.call("GET", f"/api/parameters/federation-upstream/{v}/up1")[1]["value"] == value
    finally:
        drop_vhosts(api, [vh])


# ---------------------------------------------------------------- exchange federation
@pytest.mark.cluster_modes
def test_exchange_federation_mirrors_bindings_and_marks_messages(shared_broker: Broker) -> None:
    b, api = shared_broker, api_of(shared_broker)
    up, down = vhosts(api, 2)
    cu, cd = conn(b, up), conn(b, down)
    try:
        chu, chd = cu.channel(), cd.channel()
        chu.exchange_declare("fed.x", "topic", durable=True)
        chd.exchange_declare("fed.x", "topic", durable=True)
        chd.queue_declare("dq", durable=True)
        chd.queue_bind("dq", "fed.x", "a.*")
        upstream(api, b, down, "u", up)
        policy(api, down, {"federation-upstream": "u"}, apply_to="exchanges")
        [link] = wait_running(api, down, 1)
        assert (link["type"], link["exchange"], link["upstream"], link["upstream_exchange"]) == (
            "exchange", "fed.x", "u", "fed.x")
        assert "guest@" in link["uri"] and "guest:guest" not in link["uri"]
        wait_until(lambda: upstream_bound(api, up, "fed.x", "a.*"), LINK_DEADLINE, "binding mirrored")
        chu.confirm_delivery()
        for i in range(5):
            chu.basic_publish("fed.x", "a.b", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
            chu.basic_publish("fed.x", "z.z", b"not bound")
        wait_until(lambda: count(chd, "dq") == 5, LINK_DEADLINE, "5 federated messages")
        got = drain(chd, "dq")
        assert [body for body, _ in got] == [f"m{i}".encode() for i in range(5)]
        hop = got[0][1].headers["x-received-from"][0]
        assert hop["exchange"] == "fed.x" and hop["vhost"] == up and "guest:guest" not in hop["uri"]
        # a binding added later is mirrored too; one removed is unbound upstream
        chd.queue_bind("dq", "fed.x", "late.#")
        wait_until(lambda: upstream_bound(api, up, "fed.x", "late.#"), LINK_DEADLINE, "new binding mirrored")
        chd.queue_unbind("dq", "fed.x", "a.*")
        wait_until(lambda: not upstream_bound(api, up, "fed.x", "a.*"), LINK_DEADLINE, "binding removed")
        # the policy removed: the link goes
        api.call("DELETE", f"/api/policies/{quote(down, safe='')}/federate")
        wait_until(lambda: not links(api, down), LINK_DEADLINE, "link stopped")
    finally:
        cu.close()
        cd.close()
        drop_vhosts(api, [up, down])


# ---------------------------------------------------------------- queue federation
@pytest.mark.cluster_modes
def test_queue_federation_pulls_only_for_consumers(shared_broker: Broker) -> None:
    b, api = shared_broker, api_of(shared_broker)
    up, down = vhosts(api, 2)
    cu, cd = conn(b, up), conn(b, down)
    try:
        chu, chd = cu.channel(), cd.channel()
        chu.queue_declare("fed.q", durable=True)
        chd.queue_declare("fed.q", durable=True)
        chu.confirm_delivery()
        for i in range(20):
            chu.basic_publish("", "fed.q", f"q{i}".encode(), pika.BasicProperties(delivery_mode=2))
        upstream(api, b, down, "u", up, **{"prefetch-count": 5})
        policy(api, down, {"federation-upstream-set": "all"}, apply_to="queues")
        wait_running(api, down, 1)
        time.sleep(0.5)  # the absence of a move: nothing may arrive while nobody consumes here
        assert (count(chd, "fed.q"), count(chu, "fed.q")) == (0, 20)
        got: list[bytes] = []
        chd.basic_qos(prefetch_count=3)

        def on_message(ch: Any, method: Any, _props: Any, body: bytes) -> None:
            got.append(body)
            ch.basic_ack(method.delivery_tag)
            if len(got) == 8:
                ch.basic_cancel(method.consumer_tag)

        chd.basic_consume("fed.q", on_message)
        deadline = time.monotonic() + LINK_DEADLINE
        while len(got) < 8 and time.monotonic() < deadline:
            cd.process_data_events(0.05)
        assert got == [f"q{i}".encode() for i in range(8)]
        # the consumer gone, the link stops pulling: what it had in flight (its prefetch, 5, and
        # what the consumer had taken but not acked when it went, 3) is here, the rest stays
        # upstream for consumers there
        time.sleep(0.5)
        here, there = count(chd, "fed.q"), count(chu, "fed.q")
        assert here + there == 12 and there >= 12 - 5 - 3, (here, there)
        time.sleep(0.5)
        assert (count(chd, "fed.q"), count(chu, "fed.q")) == (here, there), "pulled with no demand"
        # a consumer upstream drains the same logical queue
        rest = [body for body, _ in drain(chu, "fed.q")] + [body for body, _ in drain(chd, "fed.q")]
        assert sorted(rest) == sorted(f"q{i}".encode() for i in range(8, 20))
    finally:
        cu.close()
        cd.close()
        drop_vhosts(api, [up, down])


class _ConsumeCounter:
    """Counts the ``basic.consume`` frames a link sends through a relay (what a queue link's
    cancel/re-consume churn costs, seen on the wire): ``tap`` reads one connection's frames."""

    def __init__(self) -> None:
        self.consumes = 0

    def tap(self) -> Callable[[bytes], None]:
        buf, skip = bytearray(), 8  # the client's stream opens with the 8-byte protocol header

        def seen(data: bytes) -> None:
            nonlocal buf, skip
            buf += data
            if skip:
                cut = min(skip, len(buf))
                del buf[:cut]
                skip -= cut
            while len(buf) >= 7 and len(buf) >= 8 + int.from_bytes(buf[3:7], "big"):
                size = int.from_bytes(buf[3:7], "big")
                if buf[0] == 1 and buf[7:11] == b"\x00\x3c\x00\x14":  # basic.consume (60, 20)
                    self.consumes += 1
                del buf[:8 + size]
        return seen


@SINGLE
def test_queue_link_consumes_upstream_again_at_most_once_a_window(shared_broker: Broker) -> None:
    """A consumer here (prefetch 20, an ack per message) drains 500 messages from upstream:
    deliveries land here in bursts of up to a window that the consumer takes a moment later, and
    the link cancels and consumes again at most once per upstream window (``prefetch-count``),
    not whenever the consumer's own window is full for a moment."""
    b, api = shared_broker, api_of(shared_broker)
    up, down = vhosts(api, 2)
    counter = _ConsumeCounter()
    relay = Relay((b.host, b.port), tap=counter.tap)
    cu, cd = conn(b, up), conn(b, down)
    n = 500
    try:
        chu, chd = cu.channel(), cd.channel()
        chu.queue_declare("fed.q", durable=True)
        chd.queue_declare("fed.q", durable=True)
        chu.confirm_delivery()
        for i in range(n):
            chu.basic_publish("", "fed.q", f"m{i:04}".encode() * 200, pika.BasicProperties(delivery_mode=2))
        value = {"uri": f"amqp://guest:guest@127.0.0.1:{relay.port}/{quote(up, safe='')}",
                 "reconnect-delay": 1, "prefetch-count": 50}
        assert api.call("PUT", f"/api/parameters/federation-upstream/{quote(down, safe='')}/u",
                        {"value": value})[0] in (201, 204)
        policy(api, down, {"federation-upstream-set": "all"}, apply_to="queues")
        wait_running(api, down, 1)
        got: list[bytes] = []
        chd.basic_qos(prefetch_count=20)

        def on_message(ch: Any, method: Any, _props: Any, body: bytes) -> None:
            got.append(body)
            ch.basic_ack(method.delivery_tag)

        chd.basic_consume("fed.q", on_message)
        deadline = time.monotonic() + LINK_DEADLINE
        while len(got) < n and time.monotonic() < deadline:
            cd.process_data_events(0.05)
        assert sorted(got) == sorted(f"m{i:04}".encode() * 200 for i in range(n))
        assert 1 <= counter.consumes <= n // 50 + 2, f"{counter.consumes} basic.consume for {n} messages"
    finally:
        api.call("DELETE", f"/api/policies/{quote(down, safe='')}/federate")
        cu.close()
        cd.close()
        relay.close()
        drop_vhosts(api, [up, down])


@SINGLE
def test_in_process_upstream_on_this_broker(shared_broker: Broker) -> None:
    """A host-less URI (``amqp:///vhost``): the link runs in-process through the model, with the
    same upstream queue, bindings, hop header and settlement as over a socket."""
    b, api = shared_broker, api_of(shared_broker)
    up, down = vhosts(api, 2)
    cu, cd = conn(b, up), conn(b, down)
    try:
        chu, chd = cu.channel(), cd.channel()
        for ch in (chu, chd):
            ch.exchange_declare("fed.x", "topic", durable=True)
            ch.queue_declare("fed.q", durable=True)
        chd.queue_declare("dq", durable=True)
        chd.queue_bind("dq", "fed.x", "a.*")
        status, body, _ = api.call("PUT", f"/api/parameters/federation-upstream/{quote(down, safe='')}/local",
                                   {"value": {"uri": f"amqp:///{quote(up, safe='')}", "prefetch-count": 4}})
        assert status == 201, body
        policy(api, down, {"federation-upstream": "local"})
        found = wait_running(api, down, 2)
        assert {lk["uri"] for lk in found} == {f"amqp:///{quote(up, safe='')}"}
        wait_until(lambda: upstream_bound(api, up, "fed.x", "a.*"), LINK_DEADLINE, "binding mirrored")
        chu.confirm_delivery()
        for i in range(5):
            chu.basic_publish("fed.x", "a.b", f"x{i}".encode(), pika.BasicProperties(delivery_mode=2))
            chu.basic_publish("", "fed.q", f"q{i}".encode(), pika.BasicProperties(delivery_mode=2))
        wait_until(lambda: count(chd, "dq") == 5, LINK_DEADLINE, "exchange-federated messages")
        got = drain(chd, "dq")
        assert [m for m, _ in got] == [f"x{i}".encode() for i in range(5)]
        assert got[0][1].headers["x-received-from"][0]["vhost"] == up
        assert count(chd, "fed.q") == 0  # no consumer here: nothing moved
        assert consume_n(cd, chd, "fed.q", 5, prefetch=2) == [f"q{i}".encode() for i in range(5)]
        wait_until(lambda: count(chu, "fed.q") == 0, LINK_DEADLINE, "upstream queue drained and acked")
    finally:
        cu.close()
        cd.close()
        drop_vhosts(api, [up, down])


# ---------------------------------------------------------------- cycles and hops
def _ring(api: Api, b: Broker, edges: list[tuple[str, str]], max_hops: int) -> None:
    """Exchange federation along ``edges`` (downstream, upstream) of vhosts."""
    for down, up in edges:
        upstream(api, b, down, f"from-{up}", up, **{"max-hops": max_hops})


@SINGLE
@pytest.mark.parametrize("max_hops", [1, 2])
def test_cycles_and_chains_stop_by_max_hops_and_loop_detection(shared_broker: Broker, max_hops: int) -> None:
    """A <-> B: each message reaches each vhost once, whatever max-hops says (loop detection).
    Chain A -> B -> C (C from B, B from A): C gets it only when max-hops >= 2."""
    b, api = shared_broker, api_of(shared_broker)
    a, bb, c = vhosts(api, 3)
    conns = {v: conn(b, v) for v in (a, bb, c)}
    try:
        chans = {v: cn.channel() for v, cn in conns.items()}
        for ch in chans.values():
            ch.exchange_declare("fed.x", "fanout", durable=True)
            ch.queue_declare("sink", durable=True)
            ch.queue_bind("sink", "fed.x", "")
        # B from A and A from B (the cycle), C from B (the chain)
        _ring(api, b, [(bb, a), (a, bb), (c, bb)], max_hops)
        for v in (a, bb, c):
            policy(api, v, {"federation-upstream-set": "all"}, apply_to="exchanges")
        for v in (a, bb, c):
            wait_running(api, v, 1)
        for v, upv in ((bb, a), (a, bb), (c, bb)):
            wait_until(lambda v=v, upv=upv: upstream_bound(api, upv, "fed.x", ""), LINK_DEADLINE,
                       "bindings mirrored")
        chans[a].confirm_delivery()
        for i in range(10):
            chans[a].basic_publish("fed.x", "", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
        expect_c = 10 if max_hops >= 2 else 0
        wait_until(lambda: tuple(count(chans[v], "sink") for v in (a, bb, c)) == (10, 10, expect_c),
                   LINK_DEADLINE, "each vhost's copies")
        time.sleep(0.5)  # copies that should never come: give a cycle time to show itself
        assert tuple(count(chans[v], "sink") for v in (a, bb, c)) == (10, 10, expect_c)
    finally:
        for cn in conns.values():
            cn.close()
        drop_vhosts(api, [a, bb, c])


# ---------------------------------------------------------------- failures
class _Accepts:
    """A TCP listener that accepts and closes at once, counting attempts (an upstream that is up
    but never speaks AMQP)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                s, _ = self.sock.accept()
            except OSError:
                continue
            self.times.append(time.monotonic())
            s.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()


@pytest.fixture
def refusing_upstream() -> Iterator[_Accepts]:
    srv = _Accepts()
    yield srv
    srv.close()


@SINGLE
def test_unreachable_upstream_backs_off_and_shows_the_reason(shared_broker: Broker,
                                                             refusing_upstream: _Accepts) -> None:
    b, api = shared_broker, api_of(shared_broker)
    [down] = vhosts(api, 1)
    cd = conn(b, down)
    try:
        cd.channel().exchange_declare("fed.x", "direct", durable=True)
        v = quote(down, safe="")
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        closed_port = dead.getsockname()[1]
        dead.close()  # nothing listens there
        for name, uri in (("closed", f"amqp://guest:guest@127.0.0.1:{closed_port}/"),
                          ("mute", f"amqp://guest:guest@127.0.0.1:{refusing_upstream.port}/"),
                          ("badpw", f"amqp://guest:wrong@{b.host}:{b.port}/")):
            assert api.call("PUT", f"/api/parameters/federation-upstream/{v}/{name}", {"value": {
                "uri": uri, "reconnect-delay": 0.3}})[0] == 201
        start = time.monotonic()
        policy(api, down, {"federation-upstream-set": "all"})
        wait_until(lambda: sum(lk["status"] == "error" for lk in links(api, down)) == 3, LINK_DEADLINE,
                   "the links in error")
        by = {lk["upstream"]: lk for lk in links(api, down)}
        assert "cannot connect" in by["closed"]["error"], by
        assert by["mute"]["error"], by
        assert "ACCESS_REFUSED" in by["badpw"]["error"] or "403" in by["badpw"]["error"], by
        # a named upstream that does not exist shows as an error too
        policy(api, down, {"federation-upstream": "nowhere"})
        wait_until(lambda: any("nowhere" in str(lk.get("error")) for lk in links(api, down)), LINK_DEADLINE,
                   "missing upstream reported")
        policy(api, down, {"federation-upstream": "mute"})  # the same link goes on
        time.sleep(max(0.0, start + 3.0 - time.monotonic()))  # the back-off is what is measured
        # reconnect-delay 0.3 s doubling per failure: attempts at 0, 0.3, 0.9, 2.1 s; a hot loop
        # makes hundreds
        attempts = len(refusing_upstream.times)
        assert 2 <= attempts <= 5, [round(t - start, 2) for t in refusing_upstream.times]
        api.call("DELETE", f"/api/policies/{v}/federate")
        wait_until(lambda: not links(api, down), LINK_DEADLINE, "links stopped")
    finally:
        cd.close()
        drop_vhosts(api, [down])


# ---------------------------------------------------------------- rabbitmqadmin
@SINGLE
@pytest.mark.skipif(ADMIN is None, reason="rabbitmqadmin (Debian rabbitmq-server) is not installed")
def test_rabbitmqadmin_declares_lists_and_deletes_upstreams(shared_broker: Broker) -> None:
    """RabbitMQ's own tool: ``declare``/``list``/``delete parameter`` of federation-upstream exit 0
    (before, a declare got 400 'component not found' and had nothing to delete)."""
    name = unique("up")
    value = '{"uri": "amqp://127.0.0.1:1", "max-hops": 2}'
    ok(shared_broker, "declare", "parameter", "component=federation-upstream", f"name={name}",
       f"value={value}")
    assert name in ok(shared_broker, "list", "parameters")
    ok(shared_broker, "delete", "parameter", "component=federation-upstream", f"name={name}")
    assert name not in ok(shared_broker, "list", "parameters")
    res = admin(shared_broker, "declare", "parameter", "component=federation-upstream", f"name={name}",
                'value={"uri": "http://nope"}')
    assert res.returncode != 0 and "Traceback" not in res.stderr and "scheme" in res.stderr, res.stderr
