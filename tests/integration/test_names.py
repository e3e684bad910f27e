"""Any queue or exchange name RabbitMQ accepts, through every door, survives kill -9; a refused
one leaves nothing behind.

Theory of operation: RabbitMQ takes any UTF-8 queue or exchange name of 1 to 255 bytes (NUL,
control characters, ``<``, quotes, ``/``, ``%``, emoji) and reserves only the ``amq.`` prefix.
``Doors`` drives the four ways a name gets into Skred: AMQP (pika: queue.declare,
exchange.declare, queue.bind, confirmed persistent publishes through the default exchange and
through the new one), the management API (PUT queue and exchange, POST binding, publish), LMQ
(a put creates its queue) and definitions import (one document of queues, exchanges and
bindings, refused whole if one name is bad). Each door records what must exist afterwards
(``Expect``: queues with their message bodies, exchanges, bindings) and what was refused. The
property test lets hypothesis pick names (its own unicode text plus a list of known-hard
shapes) and doors, then kills the broker with SIGKILL, restarts it and compares the whole
vhost with ``Expect``: every accepted object and confirmed message is back, nothing refused
exists. Shrinking is off: the examples act on one live broker, so a re-run would not be the
same experiment; the failure message lists what each door did. The same doors run against a
cluster leader and through a follower in ``test_names_cluster.py``.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ._support import SkredProcess, is_external

pytestmark = [pytest.mark.skipif(is_external(), reason="kills and restarts the broker"),
              pytest.mark.timeout(240)]

EXAMPLES = int(os.environ.get("SKRED_NAMES_EXAMPLES", "30"))
HARD_NAMES = [
    "ü", "a<b>&c", "q'\"`", "a/b", "/", "%2F", "50%", "%", "\U0001F600 party", "x" * 255,
    "é" * 127, "é" * 128, "y" * 256, "\x00", "nul\x00in", "tab\tand\nnewline", " ", "\x7f",
    "amq.x", "amq.", "Amq.y", "amq", "amq.gen-abc", ".", "..", "a/../b", "\u202eright-to-left",
    "\ufeffbom", "日本語のキュー", "a{b}c", "{name}", "?x=1#frag", "a+b c", "~!@$&*()[];,=",
]
AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()
VHOST = "%2F"


def accepted(name: str) -> bool:
    """RabbitMQ's rule: 1 to 255 bytes of UTF-8, not in the reserved ``amq.`` namespace."""
    return 1 <= len(name.encode()) <= 255 and not name.startswith("amq.")


def http_accepted(name: str) -> bool:
    """The management API also refuses '.' and '..' path segments (module ``http.common``)."""
    return accepted(name) and not any(part in (".", "..") for part in name.split("/"))


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def http(port: int, method: str, path: str, body: Any = None, host: str = "127.0.0.1") -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=data, method=method)
    req.add_header("Authorization", AUTH)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Expect:
    queues: dict[str, list[bytes]] = field(default_factory=dict)  # name -> bodies, in order
    exchanges: set[str] = field(default_factory=set)
    bindings: set[tuple[str, str, str]] = field(default_factory=set)  # (source, queue, key)
    refused: set[str] = field(default_factory=set)
    journal: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.journal.append(what)


class Doors:
    """The four ways a name gets in, against one node (it may be a cluster follower)."""

    def __init__(self, amqp_url: str, mgmt_port: int, lmq_port: int | None, expect: Expect,
                 host: str = "127.0.0.1") -> None:
        self.url = amqp_url
        self.host = host
        self.mgmt_port = mgmt_port
        self.lmq_port = lmq_port
        self.expect = expect
        self.conn: pika.BlockingConnection | None = None
        self.ch: Any = None
        self.n = 0

    def channel(self) -> Any:
        if self.conn is None or not self.conn.is_open:
            self.conn = pika.BlockingConnection(pika.URLParameters(self.url))
            self.ch = None
        if self.ch is None or not self.ch.is_open:
            self.ch = self.conn.channel()
            self.ch.confirm_delivery()
        return self.ch

    def close(self) -> None:
        if self.conn is not None and self.conn.is_open:
            self.conn.close()
        self.conn = None

    def body(self, door: str) -> bytes:
        self.n += 1
        return f"{door}:{self.n}".encode()

    def publish(self, exchange: str, key: str, body: bytes) -> None:
        """A confirmed persistent publish (pika raises if it is nacked or returned)."""
        self.channel().basic_publish(exchange, key, body, pika.BasicProperties(delivery_mode=2),
                                     mandatory=True)

    # ---------------------------------------------------------------- doors
    def amqp(self, name: str) -> None:
        e = self.expect
        if not 1 <= len(name.encode()) <= 255:
            return  # an AMQP short string cannot carry it (and an empty name asks for a new one)
        try:
            self.channel().queue_declare(name, durable=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            assert not accepted(name) and exc.reply_code == 403, (name, exc)
            e.refused.add(name)
            e.note(f"amqp refused {name!r}: {exc.reply_code}")
            return
        assert accepted(name), f"AMQP accepted the reserved name {name!r}"
        body = self.body("amqp")
        self.publish("", name, body)
        self.channel().exchange_declare(name, "direct", durable=True)
        self.channel().queue_bind(name, name, routing_key=name)
        body2 = self.body("amqp-x")
        self.publish(name, name, body2)
        e.queues.setdefault(name, []).extend([body, body2])
        e.exchanges.add(name)
        e.bindings.add((name, name, name))
        e.note(f"amqp declared {name!r}")

    def api(self, name: str) -> None:
        e = self.expect
        port, host = self.mgmt_port, self.host
        status, why = http(port, "PUT", f"/api/queues/{VHOST}/{q(name)}", {"durable": True}, host)
        if not http_accepted(name):
            assert 400 <= status < 500, (name, status, why)
            status_x, why_x = http(port, "PUT", f"/api/exchanges/{VHOST}/{q(name)}",
                                   {"type": "fanout", "durable": True}, host)
            assert 400 <= status_x < 500, (name, status_x, why_x)
            e.refused.add(name)
            e.note(f"api refused {name!r}: {status} {status_x}")
            return
        assert status in (201, 204), (name, status, why)
        status, why = http(port, "PUT", f"/api/exchanges/{VHOST}/{q(name)}",
                           {"type": "fanout", "durable": True}, host)
        assert status in (201, 204), (name, status, why)
        status, why = http(port, "POST", f"/api/bindings/{VHOST}/e/{q(name)}/q/{q(name)}",
                           {"routing_key": "k"}, host)
        assert status in (201, 204), (name, status, why)
        body = self.body("api")
        status, out = http(port, "POST", f"/api/exchanges/{VHOST}/{q(name)}/publish",
                           {"properties": {"delivery_mode": 2}, "routing_key": "k",
                            "payload": body.decode(), "payload_encoding": "string"}, host)
        assert status == 200 and out == {"routed": True}, (name, status, out)
        e.queues.setdefault(name, []).append(body)
        e.exchanges.add(name)
        e.bindings.add((name, name, "k"))
        e.note(f"api declared {name!r}")

    def lmq(self, name: str) -> None:
        e = self.expect
        assert self.lmq_port is not None
        body = self.body("lmq")
        req = urllib.request.Request(f"http://127.0.0.1:{self.lmq_port}/messages/{q(name)}", data=body,
                                     method="POST")
        req.add_header("Authorization", AUTH)
        req.add_header("Content-Type", "text/plain")
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        if not accepted(name):
            assert status >= 400, (name, status)
            e.refused.add(name)
            e.note(f"lmq refused {name!r}: {status}")
            return
        assert 200 <= status < 300, (name, status)
        e.queues.setdefault(name, []).append(body)
        e.note(f"lmq put to {name!r}")

    def definitions(self, names: list[str]) -> None:
        e = self.expect
        doc = {"queues": [{"name": n, "vhost": "/", "durable": True, "auto_delete": False, "arguments": {}}
                          for n in names],
               "exchanges": [{"name": n, "vhost": "/", "type": "topic", "durable": True,
                              "auto_delete": False, "internal": False, "arguments": {}} for n in names],
               "bindings": [{"source": n, "vhost": "/", "destination": n, "destination_type": "queue",
                             "routing_key": "#", "arguments": {}} for n in names]}
        status, why = http(self.mgmt_port, "POST", "/api/definitions", doc, self.host)
        if not all(accepted(n) for n in names):
            assert status == 400, (names, status, why)
            e.refused.update(n for n in names if n not in e.queues and n not in e.exchanges)
            e.note(f"definitions refused {names!r}: {why}")
            return
        assert status in (201, 204), (names, status, why)
        for n in names:
            body = self.body("defs")
            self.publish(n, "any.key", body)
            e.queues.setdefault(n, []).append(body)
            e.exchanges.add(n)
            e.bindings.add((n, n, "#"))
        e.note(f"definitions imported {names!r}")


def check(mgmt_port: int, amqp_url: str, expect: Expect, host: str = "127.0.0.1") -> None:
    """The vhost holds exactly what ``expect`` says (queues, their messages, exchanges, bindings)."""
    trail = "\n".join(expect.journal[-60:])
    status, queues = http(mgmt_port, "GET", f"/api/queues/{VHOST}?columns=name,durable", None, host)
    assert status == 200, queues
    names = {x["name"] for x in queues}
    assert names == set(expect.queues), (
        f"missing {sorted(set(expect.queues) - names)!r}, unexpected {sorted(names - set(expect.queues))!r}\n"
        + trail)
    status, exchanges = http(mgmt_port, "GET", f"/api/exchanges/{VHOST}?columns=name", None, host)
    got_x = {x["name"] for x in exchanges} - {"", "amq.direct", "amq.fanout", "amq.topic", "amq.headers",
                                               "amq.match", "amq.rabbitmq.trace"}
    assert got_x == expect.exchanges, (sorted(expect.exchanges - got_x), sorted(got_x - expect.exchanges),
                                       trail)
    status, bindings = http(mgmt_port, "GET", f"/api/bindings/{VHOST}", None, host)
    got_b = {(b["source"], b["destination"], b["routing_key"]) for b in bindings if b["source"]}
    assert got_b == expect.bindings, (sorted(expect.bindings - got_b), sorted(got_b - expect.bindings), trail)
    assert not (expect.refused & (names | got_x)), (expect.refused & (names | got_x), trail)
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        for name, bodies in expect.queues.items():
            got: list[bytes] = []
            while len(got) <= len(bodies):
                method, _props, body = ch.basic_get(name, auto_ack=True)
                if method is None:
                    break
                got.append(body)
            assert sorted(got) == sorted(bodies), (name, got, bodies, trail)
    finally:
        conn.close()


NAME = st.one_of(st.sampled_from(HARD_NAMES),
                 st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=80))


def test_any_rabbitmq_name_through_every_door_survives_kill9(tmp_path: Path) -> None:
    b = SkredProcess(tmp_path / "data")
    b.start()
    expect = Expect()
    doors = Doors(b.url, b.mgmt_port, b.lmq_http_port, expect)
    used: set[str] = set()
    try:
        @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(door=st.sampled_from(["amqp", "api", "lmq", "definitions"]),
               names=st.lists(NAME, min_size=1, max_size=3, unique=True))
        def one(door: str, names: list[str]) -> None:
            fresh = [n for n in names if n not in used]
            used.update(fresh)
            if not fresh:
                return
            if door == "definitions":
                doors.definitions(fresh)
            else:
                for n in fresh:
                    getattr(doors, door)(n)

        # every known-hard shape once through each door, then what hypothesis picks
        hard = list(HARD_NAMES)
        for i, door in enumerate(["amqp", "api", "lmq"]):
            for n in hard[i::4]:
                used.add(n)
                getattr(doors, door)(n)
        doors.definitions([n for n in hard[3::4] if accepted(n)])
        used.update(hard)
        one()
        doors.close()
        assert expect.queues and expect.refused
        b.kill9()
        b.restart()
        check(b.mgmt_port, b.url, expect)
    finally:
        doors.close()
        b.close()


def test_refused_declares_leave_nothing_behind(tmp_path: Path) -> None:
    """A declare refused for its name, on any door, leaves no queue, exchange or directory."""
    b = SkredProcess(tmp_path / "data")
    b.start()
    try:
        before = {p.relative_to(b.data_dir) for p in b.data_dir.rglob("*") if "transient" not in p.parts}
        expect = Expect()
        doors = Doors(b.url, b.mgmt_port, b.lmq_http_port, expect)
        for n in ("amq.q1", "amq.", "z" * 256):
            doors.amqp(n)
            doors.api(n)
            doors.lmq(n)
        doors.definitions(["fine-but-with-a-bad-neighbour", "amq.bad"])
        doors.close()
        check(b.mgmt_port, b.url, expect)
        after = {p.relative_to(b.data_dir) for p in b.data_dir.rglob("*") if "transient" not in p.parts}
        assert not [p for p in after - before if p.name not in ("definitions.amqp",)], after - before
    finally:
        b.close()
