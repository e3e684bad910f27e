"""A node of two worker processes (``[main] workers = 2``, broker/shards): real processes,
real sockets, pika.

One module-scoped node with two vhosts placed on different workers by the shard map: a
client reaches its vhost through whichever worker the kernel gives its connection to
(hand-over of the socket after connection.open), the management API answers for the whole
node on any worker, a user added through one worker logs in through every worker at once,
and kill -9 of one worker stops only its vhosts until the parent restarts it, with every
confirmed message back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pika
import pytest
from pamqp import commands
from prometheus_client.parser import text_string_to_metric_families
from rstream import Consumer, ConsumerOffsetSpecification, MessageContext, OffsetType, Producer

from broker.mqtt import packets as P
from broker.shards.placement import worker_of
from broker.streamproto import codec as C

from ._raw import PROTOCOL_HEADER, RawConn, method_bytes
from ._stream_wire import StreamWire, frame, s16
from ._support import SkredProcess, free_port, is_external, params, run_async, unique, wait_until
from ._tls import PKI, make_pki, tls_args
from .test_websocket import WSRawConn
from .worker_faults import GAP_BOUND, prepare, worker_pids

pytestmark = pytest.mark.skipif(is_external(), reason="starts its own multi-worker node")

# a vhost on each worker (the shard map is pinned: tests/test_shard_placement.py)
VHOSTS = {w: next(f"wv{i}" for i in range(100) if worker_of(f"wv{i}", 2) == w) for w in (0, 1)}
CONNECTIONS = 8  # per vhost: SO_REUSEPORT spreads them, so both workers accept some


def api(b: SkredProcess, method: str, path: str, body: Any = None, user: str = "guest",
        password: str = "guest") -> tuple[int, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{b.mgmt_port}{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode(),
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw and r.headers.get_content_type() == "application/json" \
                else raw.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def connect_to(b: SkredProcess, vhost: str, user: str = "guest", password: str = "guest") \
        -> pika.BlockingConnection:
    return pika.BlockingConnection(params(b, virtual_host=vhost,
                                          credentials=pika.PlainCredentials(user, password)))


def metrics_port(b: SkredProcess) -> int:
    return int(b.extra_args[b.extra_args.index("--mgmt-metrics-port") + 1])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("workers-pki"))


def tls_port(b: SkredProcess) -> int:
    return int(b.extra_args[b.extra_args.index("--amqp-tls-port") + 1])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pki: PKI) -> Iterator[SkredProcess]:
    b = SkredProcess(tmp_path_factory.mktemp("workers") / "data", tls_args(
        pki, "--amqp-tls-port", str(free_port()), "--mgmt-tls-port", str(free_port()),
        "--mqtt-tls-port", str(free_port()), "--stream-tls-port", str(free_port()), "--workers", "2",
        "--log-level", "debug",
        "--mgmt-metrics-port", str(free_port())))
    try:
        b.start()
        prepare(b, VHOSTS.values())
        yield b
    finally:
        b.close()


def test_workers_own_their_vhosts_on_disk(node: SkredProcess) -> None:
    data = node.data_dir
    assert (data / "users.json").is_file() and (data / "vhosts.json").is_file()  # shared: the node's
    for w, vhost in VHOSTS.items():
        names = {p.read_text() for p in (data / "workers" / str(w)).glob("*/.vhost")}
        assert vhost in names
        other = {p.read_text() for p in (data / "workers" / str(1 - w)).glob("*/.vhost")}
        assert vhost not in other


def test_spark_reads_a_workers_streams_from_the_data_dir(node: SkredProcess) -> None:
    """The Spark source's ``data_dir`` mode finds a vhost in the data dir of the worker that
    keeps it (it looked only in the node's own and failed with FileNotFoundError)."""
    from broker.spark.source import _Options

    stream = unique("wstream")
    for vhost in VHOSTS.values():
        conn = connect_to(node, vhost)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
            for i in range(5):
                ch.basic_publish("", stream, f"m{i}".encode())
        finally:
            conn.close()
        opts = _Options({"data_dir": str(node.data_dir), "vhost": vhost, "subscribe": stream})
        (part,) = opts.parts
        assert opts.extent(part) == (0, 5)


def test_any_worker_reaches_every_vhost_with_confirms(node: SkredProcess) -> None:
    queue = unique("wq")
    for vhost in VHOSTS.values():
        for i in range(CONNECTIONS):
            conn = connect_to(node, vhost)
            try:
                ch = conn.channel()
                ch.confirm_delivery()
                ch.queue_declare(queue, durable=True)
                ch.basic_publish("", queue, f"{vhost}-{i}".encode(),
                                 pika.BasicProperties(delivery_mode=2), mandatory=True)
                method, _props, body = ch.basic_get(queue, auto_ack=False)
                assert method is not None and body == f"{vhost}-{i}".encode()
                ch.basic_ack(method.delivery_tag)
            finally:
                conn.close()
        # a consumer through a handed-over connection too
        conn = connect_to(node, vhost)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            for i in range(20):
                ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))
            got: list[bytes] = []
            for method, _p, body in ch.consume(queue, inactivity_timeout=5):
                assert method is not None, f"only {len(got)} of 20 delivered"
                got.append(body)
                ch.basic_ack(method.delivery_tag)
                if len(got) == 20:
                    break
            ch.cancel()
            assert got == [str(i).encode() for i in range(20)]
            ch.queue_delete(queue)
        finally:
            conn.close()
    log = node.log_text()
    for vhost in VHOSTS.values():  # each worker handed connections of the other's vhost over
        assert re.search(rf"handed over to the worker of vhost '{vhost}'", log), f"no hand-over for {vhost}"


def test_frames_pipelined_after_connection_open_reach_the_owner(node: SkredProcess) -> None:
    """Bytes a client sends right behind connection.open (read with it by the accepting worker)
    travel with the hand-over: the owner parses them after its open-ok."""
    queue = unique("pipe")
    for vhost in VHOSTS.values():
        for _ in range(CONNECTIONS):
            c = RawConn("127.0.0.1", node.port)
            try:
                c.send(PROTOCOL_HEADER)
                c.expect(commands.Connection.Start, 0)
                c.send_method(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                                             response="\0guest\0guest", locale="en_US"))
                tune = c.expect(commands.Connection.Tune, 0)
                c.send(method_bytes(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
                       + method_bytes(0, commands.Connection.Open(virtual_host=vhost))
                       + method_bytes(1, commands.Channel.Open())
                       + method_bytes(1, commands.Queue.Declare(queue=queue, auto_delete=True)))
                c.expect(commands.Connection.OpenOk, 0)
                c.expect(commands.Channel.OpenOk, 1)
                assert c.expect(commands.Queue.DeclareOk, 1).queue == queue
            finally:
                c.close()


def test_tls_connections_are_relayed_to_the_owner(node: SkredProcess, pki: PKI) -> None:
    """A TLS session cannot change process: the accepting worker relays its decrypted bytes.
    SO_REUSEPORT picks the accepting worker by a hash of the client's address, so a vhost's
    first connections may all land on its owner: connect on (bounded) until one was relayed."""
    queue = unique("tq")

    def round_trip(vhost: str, i: int) -> None:
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            "localhost", tls_port(node), vhost, pika.PlainCredentials("guest", "guest"),
            ssl_options=pika.SSLOptions(pki.client_context(), "localhost"), socket_timeout=5))
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(queue, auto_delete=True)
            body = f"{vhost}-{i}-".encode() * 2000  # larger than one TLS record
            ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
            method, _props, got = ch.basic_get(queue, auto_ack=True)
            assert method is not None and got == body
        finally:
            conn.close()

    for vhost in VHOSTS.values():
        relayed = rf"relayed to the worker of vhost '{vhost}'"
        for i in range(8 * CONNECTIONS):
            round_trip(vhost, i)
            if i + 1 >= CONNECTIONS and re.search(relayed, node.log_text()):
                break
        assert re.search(relayed, node.log_text()), f"no relay for {vhost} in {8 * CONNECTIONS} connections"


def test_amqp_over_websocket_is_relayed_to_the_owner(node: SkredProcess) -> None:
    queue = unique("wsq")
    for vhost in VHOSTS.values():
        tcp = connect_to(node, vhost)
        ch = tcp.channel()
        ch.queue_declare(queue, auto_delete=True)
        for _ in range(4):  # the management port spreads them over both workers too
            ws = WSRawConn(f"ws://127.0.0.1:{node.mgmt_port}/ws")
            try:
                ws.handshake(vhost=vhost)
                ws.open_channel(1)
                ws.publish(1, "", queue, b"over websocket")
            finally:
                ws.close()
        got = 0
        deadline = time.monotonic() + 10
        while got < 4 and time.monotonic() < deadline:
            method, _p, _body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                tcp.process_data_events(0.02)
            else:
                got += 1
        tcp.close()
        assert got == 4, vhost


class _MQTT:
    """A paho client (MQTT 3.1.1) logged in to ``vhost`` as guest; what it received."""

    def __init__(self, port: int, vhost: str, ctx: Any = None, client_id: str = "",
                 clean: bool = True, websocket: bool = False) -> None:
        self.got: list[bytes] = []
        self.subscribed: list[int] = []
        c = self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                      client_id=client_id or unique("wm")[-20:],
                                      protocol=mqtt.MQTTv311, clean_session=clean,
                                      transport="websockets" if websocket else "tcp")
        if websocket:
            c.ws_set_options(path="/mqtt")
        c.on_subscribe = lambda _c, _u, mid, _rc, _p: self.subscribed.append(mid)
        c.username_pw_set(f"{vhost}:guest", "guest")
        if ctx is not None:
            c.tls_set_context(ctx)
        c.on_message = lambda _c, _u, m: self.got.append(m.payload)
        c.connect("localhost", port, keepalive=30)
        c.loop_start()
        wait_until(c.is_connected, 10, f"MQTT CONNACK in vhost {vhost}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class _Acked(threading.Thread):
    """QoS 1 publishes to ``vhost`` one after another (bounded: 5,000 or 30 s), and the longest
    wait for a PUBACK: what a neighbour of a dying worker sees."""

    def __init__(self, port: int, vhost: str) -> None:
        super().__init__(daemon=True)
        self.mqtt = _MQTT(port, vhost)
        self.halt = threading.Event()
        self.acked = 0
        self.gap = 0.0

    def run(self) -> None:
        deadline = time.monotonic() + 30
        last = time.monotonic()
        for i in range(5000):
            if self.halt.is_set() or time.monotonic() > deadline:
                break
            self.mqtt.client.publish("n/a", str(i).encode(), qos=1).wait_for_publish(10)
            now = time.monotonic()
            self.gap, last = max(self.gap, now - last), now
            self.acked += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(15)
        self.mqtt.close()


def mqtt_tls_port(b: SkredProcess) -> int:
    return int(b.extra_args[b.extra_args.index("--mqtt-tls-port") + 1])


def test_mqtt_reaches_every_vhost_through_any_worker(node: SkredProcess, pki: PKI) -> None:
    """CONNECT names the vhost (``vhost:user``): the accepting worker hands the socket (plain) or
    relays the bytes (TLS) to the vhost's owner, which answers CONNACK; a QoS 1 round trip."""
    def round_trip(port: int, vhost: str, ctx: Any) -> None:
        c = _MQTT(port, vhost, ctx, websocket=port == node.mgmt_port)
        try:
            topic = f"w/{vhost}"
            c.client.subscribe(topic, qos=1)
            body = f"{vhost}-".encode() * (3000 if ctx else 1)  # TLS: several records
            c.client.publish(topic, body, qos=1).wait_for_publish(10)
            wait_until(lambda: body in c.got, 10, f"MQTT round trip in {vhost}")
        finally:
            c.close()

    for vhost in VHOSTS.values():
        for port, ctx, how in ((node.mqtt_port, None, r"\(mqtt\) handed over to"),
                               (mqtt_tls_port(node), pki.client_context(), r"\(mqtt/ssl\) relayed to"),
                               (node.mgmt_port, None, r"\(http\) relayed to")):  # MQTT over WebSocket
            _until_logged(node, f"MQTT connection .*{how} the worker of vhost '{vhost}'",
                          lambda port=port, vhost=vhost, ctx=ctx: round_trip(port, vhost, ctx))


def test_mqtt_packets_pipelined_after_connect_reach_the_owner(node: SkredProcess) -> None:
    """CONNECT, SUBSCRIBE and PUBLISH in one write: the bytes after CONNECT go along with the
    socket, and the owner answers all three (CONNACK, SUBACK, the message back)."""
    for vhost in VHOSTS.values():
        pattern = rf"MQTT connection .*\(mqtt\) handed over to the worker of vhost '{vhost}'"
        before = len(re.findall(pattern, node.log_text()))
        for i in range(32):  # until one landed on the other worker
            topic, body = f"p/{i}", f"pipelined {vhost} {i}".encode()
            connect = P.Connect("MQTT", 4, True, 30, unique("wp")[-20:], None, f"{vhost}:guest", b"guest")
            sock = socket.create_connection(("127.0.0.1", node.mqtt_port), timeout=10)
            try:
                sock.sendall(P.encode_connect(connect) + P.encode_subscribe(P.Subscribe(1, ((topic, 0),)))
                             + P.encode_publish(topic, body, 0, False, False, 0))
                got = b""
                deadline = time.monotonic() + 10
                while body not in got and time.monotonic() < deadline:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                assert got[:4] == bytes((0x20, 2, 0, 0)) and body in got, (vhost, got)
            finally:
                sock.close()
            if len(re.findall(pattern, node.log_text())) > before:
                break
        else:
            raise AssertionError(f"no MQTT connection to {vhost} was handed over")


def test_stream_protocol_reaches_every_vhost_through_any_worker(node: SkredProcess, pki: PKI) -> None:
    """Open names the vhost: the accepting worker hands the socket (TLS: relays the bytes), with
    the user and tuning it negotiated, to the vhost's owner, which answers Open and what was
    pipelined after it (raw frames, so both workers accept some); rstream publishes and reads
    back through it."""
    tls = int(node.extra_args[node.extra_args.index("--stream-tls-port") + 1])
    for vhost in VHOSTS.values():
        for port, how in ((node.stream_port, "handed over to"), (tls, "relayed to")):
            _until_logged(node, f"stream connection .*{how} the worker of vhost '{vhost}'",
                          lambda port=port, vhost=vhost: _stream_open(node, pki, port, vhost))

    async def scenario() -> None:  # a real client: one stream per vhost, published and read
        kw: dict[str, Any] = {"port": node.stream_port, "username": "guest", "password": "guest"}
        for vhost in VHOSTS.values():
            stream = unique("ws")
            sent = [f"{vhost}-{i}".encode() for i in range(10)]
            async with Producer("localhost", vhost=vhost, **kw) as p:
                await p.create_stream(stream)
                await p.send_batch(stream, sent)
            got: list[bytes] = []

            def on_message(msg: Any, _ctx: MessageContext, got: list[bytes] = got) -> None:
                got.append(bytes(msg))

            c = Consumer("localhost", vhost=vhost, **kw)
            await c.start()
            try:
                await c.subscribe(stream, on_message,
                                  offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None))
                deadline = time.monotonic() + 10
                while len(got) < len(sent) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)  # poll, bounded by the deadline
                assert got == sent, vhost
                await c.delete_stream(stream)
            finally:
                await c.close()

    run_async(scenario(), 60)


def _stream_open(node: SkredProcess, pki: PKI, port: int, vhost: str) -> None:
    """A raw stream connection to ``vhost`` (TLS unless on the plain port) that sends Open and
    Create in one write (Create must reach the owner too) and checks both answers."""
    w = StreamWire("localhost", port)
    if port != node.stream_port:
        w.sock = pki.client_context().wrap_socket(w.sock, server_hostname="localhost")
    try:
        assert w.request(C.PEER_PROPERTIES, struct.pack(">i", 0)) == C.OK
        assert w.request(C.SASL_HANDSHAKE, b"") == C.OK
        auth = b"\0guest\0guest"
        assert w.request(C.SASL_AUTHENTICATE, s16("PLAIN") + struct.pack(">i", len(auth)) + auth) == C.OK
        w.send(frame(C.TUNE, w.expect(C.TUNE)))
        stream = unique("ws")
        w.send(frame(C.OPEN, struct.pack(">I", 1) + s16(vhost))
               + frame(C.CREATE, struct.pack(">I", 2) + s16(stream) + struct.pack(">i", 0)))
        for key in (C.OPEN, C.CREATE):
            payload = w.expect(key | C.RESPONSE)
            assert struct.unpack_from(">H", payload, 4)[0] == C.OK, (vhost, port, key)
        assert w.request(C.DELETE, s16(stream)) == C.OK
    finally:
        w.close()


def _until_logged(node: SkredProcess, pattern: str, attempt: Callable[[], None], most: int = 32) -> None:
    """``attempt`` (a connection and its round trip) until the node logged ``pattern``: the
    kernel spreads connections over the workers at random, so a few reach the other one."""
    for _ in range(most):
        attempt()
        if re.search(pattern, node.log_text()):
            return
    raise AssertionError(f"{most} connections, none logged {pattern!r}")


def test_lmq_is_served_by_the_worker_of_its_vhost(node: SkredProcess) -> None:
    """LMQ's state is one vhost's (``[lmq] vhost``): that vhost's worker alone listens on the LMQ
    ports, so any request reaches it; a put and a get through the HTTP API."""
    q = unique("lmq")
    url = f"http://127.0.0.1:{node.lmq_http_port}/messages/{q}"
    auth = {"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()}
    for i in range(4):
        req = urllib.request.Request(url, method="POST", data=f"job {i}".encode(),
                                     headers={**auth, "Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10) as r:
            assert r.status == 200 and r.read() == f"job {i}".encode()


def test_management_api_answers_for_the_whole_node(node: SkredProcess) -> None:
    queues = {w: unique(f"mq{w}") for w in VHOSTS}
    conns = []
    try:
        for w, vhost in VHOSTS.items():
            conn = connect_to(node, vhost)
            conns.append(conn)
            conn.channel().queue_declare(queues[w], durable=True)
        for _ in range(4):  # whichever worker each request lands on
            status, listed = api(node, "GET", "/api/queues")
            assert status == 200
            assert {(q["vhost"], q["name"]) for q in listed} >= {(VHOSTS[w], queues[w]) for w in VHOSTS}
            req = urllib.request.Request(f"http://127.0.0.1:{node.mgmt_port}/api/queues", headers={
                "Authorization": "Basic " + base64.b64encode(b"guest:guest").decode(),
                "X-Skred-Worker-Local": "1"})  # only a worker's private port narrows an answer
            with urllib.request.urlopen(req, timeout=10) as r:
                narrowed = {(q["vhost"], q["name"]) for q in json.loads(r.read())}
            assert narrowed >= {(VHOSTS[w], queues[w]) for w in VHOSTS}
            status, page = api(node, "GET", "/api/queues?page=1&page_size=500&columns=name,vhost&sort=name")
            assert status == 200 and page["total_count"] >= 2, page
            paged = {(q["vhost"], q["name"]) for q in page["items"]}
            assert paged >= {(VHOSTS[w], queues[w]) for w in VHOSTS}
            assert [q["name"] for q in page["items"]] == sorted(q["name"] for q in page["items"])
            status, vhosts = api(node, "GET", "/api/vhosts")
            names = [v["name"] for v in vhosts]
            assert set(VHOSTS.values()) | {"/"} <= set(names) and len(names) == len(set(names))
            status, connections = api(node, "GET", "/api/connections")
            assert {c["vhost"] for c in connections} >= set(VHOSTS.values())
            status, overview = api(node, "GET", "/api/overview")
            assert overview["object_totals"]["queues"] >= 2
            assert overview["object_totals"]["connections"] >= 2
            status, text = api(node, "GET", "/metrics")
            assert status == 200
            found = re.search(r"^rabbitmq_queues (\d+)", text, re.M)
            assert found is not None and int(found.group(1)) >= 2, text[:2000]
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(node)}/metrics", timeout=10) as r:
                found = re.search(r"^rabbitmq_queues (\d+)", r.read().decode(), re.M)
            assert found is not None and int(found.group(1)) >= 2  # the port without auth too
            # one connection by name, wherever it is
            for c in connections:
                if c["vhost"] in VHOSTS.values():
                    name = urllib.parse.quote(c["name"], safe="")
                    status, one = api(node, "GET", f"/api/connections/{name}")
                    assert status == 200 and one["name"] == c["name"], (status, one)
            # the whole node's definitions: every worker's vhosts and topology in one document,
            # sorted as one worker sorts them
            status, whole = api(node, "GET", "/api/definitions")
            assert status == 200, whole
            assert {v["name"] for v in whole["vhosts"]} >= set(VHOSTS.values()) | {"/"}
            assert len(whole["vhosts"]) == len({v["name"] for v in whole["vhosts"]})
            mine = {(VHOSTS[w], queues[w]) for w in VHOSTS}
            assert {(q["vhost"], q["name"]) for q in whole["queues"]} >= mine
            assert whole["queues"] == sorted(whole["queues"], key=lambda q: (q["vhost"], q["name"]))
            assert {u["name"] for u in whole["users"]} >= {"guest"}
            # an import naming one worker's vhosts goes whole to that worker (all or nothing
            # there); one naming several workers' is refused before anything happens
            for w, vhost in VHOSTS.items():
                q, user = unique(f"dq{w}"), unique(f"du{w}")[-24:]
                doc = {"users": [{"name": user, "password": "pw", "tags": ""}],
                       "permissions": [{"user": user, "vhost": vhost, "configure": ".*", "write": ".*",
                                        "read": ".*"}],
                       "queues": [{"name": q, "vhost": vhost, "durable": True, "auto_delete": False,
                                   "arguments": {}}]}
                assert api(node, "POST", "/api/definitions", doc)[0] == 204
                assert api(node, "GET", f"/api/queues/{vhost}/{q}")[0] == 200
                connect_to(node, vhost, user, "pw").close()
            spanning = {"queues": [{"name": f"span-{w}", "vhost": v, "durable": True, "auto_delete": False,
                                    "arguments": {}} for w, v in VHOSTS.items()]}
            status, refused = api(node, "POST", "/api/definitions", spanning)
            assert status == 501 and "per vhost" in refused, refused
            for w, vhost in VHOSTS.items():
                assert api(node, "GET", f"/api/queues/{vhost}/span-{w}")[0] == 404
            for vhost in VHOSTS.values():
                status, doc = api(node, "GET", f"/api/definitions/{urllib.parse.quote(vhost, safe='')}")
                assert status == 200 and {q["name"] for q in doc["queues"]} & set(queues.values())
            # a vhost's own resources: answered by its owner, wherever the request lands
            for w, vhost in VHOSTS.items():
                status, q = api(node, "GET", f"/api/queues/{vhost}/{queues[w]}")
                assert status == 200 and q["name"] == queues[w]
    finally:
        for conn in conns:
            ch = conn.channel()
            for q in queues.values():
                try:
                    ch.queue_delete(q)
                except pika.exceptions.ChannelClosedByBroker:
                    ch = conn.channel()
            conn.close()


def test_overview_and_metrics_are_the_sum_of_every_vhosts_part(node: SkredProcess) -> None:
    # each figure of the whole node's overview and /metrics (either port) equals the sum of what
    # each vhost's owner reports of its vhost; a family's samples stay under its TYPE. Checked
    # "at least 2" before; exact, /metrics said skred_users 2 for one user (summed per worker),
    # and the other worker's per-queue samples came after another family's TYPE
    queues = {w: unique(f"sq{w}") for w in VHOSTS}
    for w, vhost in VHOSTS.items():
        with connect_to(node, vhost) as conn:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(queues[w], durable=True)
            for i in range(w + 2):
                ch.basic_publish("", queues[w], f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))

    def parts() -> tuple[int, int]:
        listed = [q for v in api(node, "GET", "/api/vhosts")[1]
                  for q in api(node, "GET", f"/api/queues/{urllib.parse.quote(v['name'], safe='')}")[1]]
        return len(listed), sum(int(q.get("messages", 0)) for q in listed)

    def whole() -> tuple[int, int]:
        doc = api(node, "GET", "/api/overview")[1]
        return doc["object_totals"]["queues"], doc["queue_totals"].get("messages", 0)

    wait_until(lambda: whole() == parts(), 15, "the overview's totals equal the sum of the vhosts' parts")
    count, messages = parts()
    for reverse in (False, True):  # sorted once joined (main: each part apart, one order was wrong)
        arranged = [q["name"] for q in api(node, "GET", f"/api/queues?sort=name&sort_reverse={reverse}")[1]]
        assert arranged == sorted(arranged, reverse=reverse), reverse
    users = len(api(node, "GET", "/api/users")[1])
    texts = [api(node, "GET", "/metrics")[1]]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(node)}/metrics", timeout=10) as r:
        texts.append(r.read().decode())  # the port without auth
    for text in texts:
        families: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            assert family.name not in families, f"{family.name} in two groups"
            families[family.name] = {repr(sorted(s.labels.items())): s.value for s in family.samples}
        assert families["rabbitmq_queues"] == {"[]": count}
        assert families["rabbitmq_queue_messages"] == {"[]": messages}
        assert families["skred_users"] == {"[]": users}  # the node's one users file
    per: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(api(node, "GET", "/metrics/per-object")[1]):
        assert family.name not in per, f"{family.name} in two groups"  # main: the 2nd worker's apart
        per[family.name] = [(s.labels, s.value) for s in family.samples]
    for w, vhost in VHOSTS.items():
        assert [v for labels, v in per["rabbitmq_queue_messages"]
                if labels.get("vhost") == vhost and labels.get("queue") == queues[w]] == [w + 2]


def test_user_added_on_one_worker_logs_in_through_every_worker_at_once(node: SkredProcess) -> None:
    for _ in range(2):
        user, password = unique("u"), "secret-" + unique("p")
        assert api(node, "PUT", f"/api/users/{user}", {"password": password, "tags": ""})[0] in (201, 204)
        for vhost in VHOSTS.values():
            assert api(node, "PUT", f"/api/permissions/{vhost}/{user}",
                       {"configure": ".*", "write": ".*", "read": ".*"})[0] in (201, 204)
        # at once: no retry, on connections both workers accept
        for vhost in VHOSTS.values():
            for _ in range(CONNECTIONS // 2):
                connect_to(node, vhost, user, password).close()
        assert api(node, "DELETE", f"/api/users/{user}")[0] == 204
        for vhost in VHOSTS.values():
            for _ in range(2):  # few: the login throttle slows a user's failures down after 5
                with pytest.raises(pika.exceptions.ProbableAuthenticationError):
                    connect_to(node, vhost, user, password)


def _connect_again(node: SkredProcess, vhost: str, seconds: float) -> pika.BlockingConnection:
    """``connect_to``, tried again for a bounded time on a refused or reset connection."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return connect_to(node, vhost)
        except pika.exceptions.AMQPConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_kill9_of_a_worker_stops_only_its_vhosts_and_loses_nothing_confirmed(node: SkredProcess) -> None:
    victim = 1
    doomed, other = VHOSTS[victim], VHOSTS[1 - victim]
    queue = unique("kq")
    conn = connect_to(node, doomed)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(queue, durable=True)
    confirmed: list[bytes] = []
    stop = threading.Event()
    # MQTT too: a persistent session's QoS 1 subscription in the doomed vhost, fed 50 acked
    # messages before the kill; a QoS 1 publisher in the other vhost timing its acks through it
    session_id = unique("ks")[-20:]
    sub = _MQTT(node.mqtt_port, doomed, client_id=session_id, clean=False)
    sub.client.subscribe("k/#", qos=1)
    wait_until(lambda: bool(sub.subscribed), 10, "SUBACK")
    sub.close()
    pub = _MQTT(node.mqtt_port, doomed)
    mqtt_sent = [f"k{i}".encode() for i in range(50)]
    for body in mqtt_sent:
        pub.client.publish("k/a", body, qos=1).wait_for_publish(10)
    pub.close()
    neighbour = _Acked(node.mqtt_port, other)
    neighbour.start()

    def publish() -> None:  # bounded: 2,000 messages or 10 s
        deadline = time.monotonic() + 10
        try:
            for i in range(2000):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                body = f"m{i}".encode()
                ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
                confirmed.append(body)
        except (pika.exceptions.AMQPError, OSError):
            return

    t = threading.Thread(target=publish)
    t.start()
    wait_until(lambda: len(confirmed) >= 50 or not t.is_alive(), 10, "confirmed publishes")
    pid = worker_pids(node)[victim]
    os.kill(pid, signal.SIGKILL)
    t.join(15)
    stop.set()
    assert len(confirmed) >= 50
    # the other worker's vhost keeps serving meanwhile. A connection the kernel queued on the
    # dying worker's listener (SO_REUSEPORT: each worker has its own) is reset, as a client
    # connecting at that instant sees it; it connects again
    c2 = _connect_again(node, other, 10)
    try:
        ch2 = c2.channel()
        ch2.confirm_delivery()
        q2 = ch2.queue_declare("", exclusive=True).method.queue
        ch2.basic_publish("", q2, b"still here")
        assert ch2.basic_get(q2, auto_ack=True)[2] == b"still here"
    finally:
        c2.close()
    # the parent restarts the worker; its vhost serves again with every confirmed message
    wait_until(lambda: worker_pids(node).get(victim, pid) != pid, 15, "worker restarted")

    def serving() -> bool:
        try:
            connect_to(node, doomed).close()
            return True
        except (pika.exceptions.AMQPError, OSError):
            return False

    wait_until(serving, 20, f"vhost {doomed} served again")
    neighbour.stop()
    # the chaos trial holds the neighbour to GAP_BOUND; here, beside another test file on a
    # loaded CI machine, twice that
    assert neighbour.acked >= 10 and neighbour.gap < 2 * GAP_BOUND, (neighbour.acked, neighbour.gap)
    back = _MQTT(node.mqtt_port, doomed, client_id=session_id, clean=False)  # the session, restored
    try:
        wait_until(lambda: len(set(back.got)) >= len(mqtt_sent), 15, "the session's acked messages")
        assert set(back.got) == set(mqtt_sent)
    finally:
        back.close()
    c3 = connect_to(node, doomed)
    try:
        ch3 = c3.channel()
        seen: set[bytes] = set()
        while True:
            method, _p, body = ch3.basic_get(queue, auto_ack=True)
            if method is None:
                break
            seen.add(body)
        lost = [b for b in confirmed if b not in seen]
        assert not lost, f"{len(lost)} confirmed messages lost, e.g. {lost[:5]}"
        ch3.queue_delete(queue)
    finally:
        c3.close()
    assert "died (signal 9): restarting it" in node.log_text()
    if conn.is_open:
        try:
            conn.close()
        except (pika.exceptions.AMQPError, OSError):
            pass


@pytest.mark.parametrize("listener", ["port", "lmq_rpc_port"])
def test_a_second_node_on_a_port_of_ours_fails_at_start(
        node: SkredProcess, tmp_path_factory: pytest.TempPathFactory, listener: str) -> None:
    """AMQP: SO_REUSEPORT would let it bind beside our workers and take half of their clients.
    LMQ listens in one worker only; the parent holds its ports as it holds the others, so the
    clash is found before any worker runs (not logged by a worker of a node that runs on)."""
    other = SkredProcess(tmp_path_factory.mktemp("same-port") / "data", ["--workers", "2"])
    setattr(other, listener, getattr(node, listener))
    try:
        proc = other.spawn()
        assert proc.wait(60) == 1
        assert f"cannot listen on 127.0.0.1:{getattr(node, listener)}" in other.log_text()
    finally:
        other.close()


def test_sighup_is_passed_to_every_worker(node: SkredProcess) -> None:
    pids = worker_pids(node)
    assert node.pid is not None
    os.kill(node.pid, signal.SIGHUP)
    for w in pids:
        wait_until(lambda w=w: f"skred.w{w}: SIGHUP: reloaded" in node.log_text(), 10, f"worker {w} reloaded")
    assert worker_pids(node) == pids and "died" not in node.log_text().split("SIGHUP")[-1]


def test_sigterm_stops_every_worker(node: SkredProcess) -> None:  # last: it stops the module's node
    pids = worker_pids(node)
    assert len(pids) == 2
    assert node.stop() == 0
    for pid in pids.values():
        wait_until(lambda p=pid: not os.path.exists(f"/proc/{p}"), 10, f"worker {pid} gone")
    assert "all workers stopped" in node.log_text()


def test_workers_stop_when_their_parent_is_killed(tmp_path: Path) -> None:
    b = SkredProcess(tmp_path / "data", ["--workers", "2", "--no-lmq", "--no-mqtt"])
    try:
        b.start()
        pids = worker_pids(b)
        assert len(pids) == 2
        b.kill9()  # the parent only: its workers see the control channel close and stop
        for pid in pids.values():
            wait_until(lambda p=pid: not os.path.exists(f"/proc/{p}") or _zombie(p), 20, f"worker {pid} gone")
    finally:
        b.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_changing_the_number_of_workers_keeps_every_message(tmp_path: Path) -> None:
    """2 workers -> 1 -> 2: each vhost's directory moves to its new owner, messages with it."""
    data = tmp_path / "data"
    b = SkredProcess(data, ["--workers", "2"])
    try:
        b.start()
        prepare(b, VHOSTS.values())
        for vhost in VHOSTS.values():
            conn = connect_to(b, vhost)
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare("kept", durable=True)
            for i in range(10):
                ch.basic_publish("", "kept", f"{vhost}-{i}".encode(), pika.BasicProperties(delivery_mode=2))
            conn.close()
        for workers in ("1", "2"):
            assert b.stop() == 0
            b.extra_args[b.extra_args.index("--workers") + 1] = workers
            b.start()
            for vhost in VHOSTS.values():
                conn = connect_to(b, vhost)
                n = conn.channel().queue_declare("kept", durable=True, passive=True).method.message_count
                conn.close()
                assert n == 10, (workers, vhost, n)
    finally:
        b.close()
