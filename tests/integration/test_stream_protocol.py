"""The RabbitMQ Stream protocol with the rstream client: publish, consume, dedup, offsets, super streams.

Every test runs against a single node, a cluster's leader and through a follower (``cluster_modes``):
through a follower the client uses rstream's ``load_balancer_mode``, as it would behind a load
balancer, since Metadata names the leader's address and every connection through the follower
reaches the leader. The same scenarios run against RabbitMQ 3.10's stream plugin in
``test_stream_protocol_rabbitmq.py``; the differences are listed in docs/compatibility.md.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import re
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

import pika
import pytest
from rstream import (
    AMQPMessage,
    CompressionType,
    Consumer,
    ConsumerOffsetSpecification,
    MessageContext,
    OffsetSpecification,
    OffsetType,
    Producer,
    SuperStreamConsumer,
    SuperStreamProducer,
    amqp_decoder,
)
from rstream.superstream import SuperStreamCreationOption

from broker.streamproto import codec as C

from ._stream_wire import StreamWire, frame, s16
from ._support import Broker, connect, run_async

pytestmark = pytest.mark.cluster_modes


class Target:
    """How an rstream client reaches the broker under test."""

    def __init__(self, b: Any, mode: str) -> None:
        url = urlparse(b.url)
        self.host = b.host
        self.port = int(b.stream_port)
        self.user = url.username or "guest"
        self.password = url.password or "guest"
        self.lb = mode == "follower"

    def kw(self) -> dict[str, Any]:
        return {"port": self.port, "username": self.user, "password": self.password,
                "load_balancer_mode": self.lb}

    def producer(self) -> Producer:
        return Producer(self.host, **self.kw())

    def consumer(self) -> Consumer:
        return Consumer(self.host, **self.kw())


@pytest.fixture
def target(shared_broker: Broker, broker_mode: str) -> Target:
    return Target(shared_broker, broker_mode)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def _until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)  # poll interval, bounded by the deadline


async def _read(t: Target, stream: str, n: int, spec: ConsumerOffsetSpecification,
                decoder: Callable[[bytes], Any] | None = None,
                timeout: float = 10.0) -> list[tuple[int, Any]]:
    """(offset, message) of the first ``n`` deliveries from ``spec``."""
    got: list[tuple[int, Any]] = []

    def on_message(msg: Any, ctx: MessageContext) -> None:
        got.append((ctx.offset, msg))

    c = t.consumer()
    await c.start()
    try:
        await c.subscribe(stream, on_message, offset_specification=spec, decoder=decoder)
        await _until(lambda: len(got) >= n, timeout, f"{n} messages from {stream}")
    finally:
        await c.close()
    return got[:n]


def _first() -> ConsumerOffsetSpecification:
    return ConsumerOffsetSpecification(OffsetType.FIRST, None)


def test_publish_consume_round_trip_with_offsets_in_order(target: Target) -> None:
    stream = _name("sp")

    async def scenario() -> None:
        async with target.producer() as p:
            await p.create_stream(stream)
            await p.send_batch(stream, [f"m{i}".encode() for i in range(50)])
            await p.send_wait(stream, AMQPMessage(body=b"amqp-1.0 body"))
        got = await _read(target, stream, 51, _first())
        assert [o for o, _ in got] == list(range(51))
        assert [m for _, m in got[:50]] == [f"m{i}".encode() for i in range(50)]
        at_50 = ConsumerOffsetSpecification(OffsetType.OFFSET, 50)
        last = await _read(target, stream, 1, at_50, amqp_decoder)
        assert last[0][0] == 50 and bytes(last[0][1].body) == b"amqp-1.0 body"
        async with target.producer() as p:
            await p.delete_stream(stream)

    run_async(scenario(), 40)


def test_offset_specs_next_last_offset_timestamp(target: Target) -> None:
    stream = _name("spec")

    async def scenario() -> None:
        async with target.producer() as p:
            await p.create_stream(stream)
            await p.send_batch(stream, [b"old-%d" % i for i in range(5)])
            await asyncio.sleep(0.05)  # the timestamp spec below must fall between the two batches
            cut = int(time.time() * 1000)
            await asyncio.sleep(0.05)
            await p.send_batch(stream, [b"new-%d" % i for i in range(5)])
        by_ts = await _read(target, stream, 5, ConsumerOffsetSpecification(OffsetType.TIMESTAMP, cut))
        assert [m for _, m in by_ts] == [b"new-%d" % i for i in range(5)]
        by_offset = await _read(target, stream, 2, ConsumerOffsetSpecification(OffsetType.OFFSET, 3))
        assert [o for o, _ in by_offset] == [3, 4]
        # LAST: the first message of the last chunk stored, i.e. of the second batch (RabbitMQ's
        # semantics: a chunk is what one Publish frame stored)
        last = await _read(target, stream, 5, ConsumerOffsetSpecification(OffsetType.LAST, None))
        assert [(o, m) for o, m in last] == [(5 + i, b"new-%d" % i) for i in range(5)]
        # NEXT: only what is published after the subscription
        got: list[bytes] = []
        c = target.consumer()
        await c.start()
        await c.subscribe(stream, lambda m, _ctx: got.append(m),
                          offset_specification=ConsumerOffsetSpecification(OffsetType.NEXT, None))
        async with target.producer() as p:
            await p.send_wait(stream, b"after")
        await _until(lambda: got == [b"after"], 10, "the message published after subscribing")
        await c.close()

    run_async(scenario(), 40)


def test_deduplication_by_producer_name_and_publishing_id(target: Target) -> None:
    stream = _name("dedup")

    async def scenario() -> None:
        async with target.producer() as p:
            await p.create_stream(stream)
            for i in range(1, 6):
                await p.send_wait(stream, _with_id(b"x%d" % i, i), publisher_name="app")
        async with target.producer() as p:  # a restarted publisher resends 3..7: 3..5 are duplicates
            for i in range(3, 8):
                await p.send_wait(stream, _with_id(b"x%d" % i, i), publisher_name="app")
            client = await p.default_client
            assert await client.query_publisher_sequence(stream, "app") == 7
            assert await client.query_publisher_sequence(stream, "nobody") == 0
        got = await _read(target, stream, 7, _first(), amqp_decoder)
        assert [bytes(m.body) for _, m in got] == [b"x%d" % i for i in range(1, 8)]
        consumer = target.consumer()
        await consumer.start()
        try:  # nothing past the seventh message
            extra: list[Any] = []
            await consumer.subscribe(stream, lambda m, _c: extra.append(m),
                                     offset_specification=ConsumerOffsetSpecification(OffsetType.OFFSET, 7))
            await asyncio.sleep(0.3)  # a duplicate stored would arrive within this window
            assert extra == []
        finally:
            await consumer.close()

    run_async(scenario(), 40)


def test_store_and_query_offset_resume(target: Target) -> None:
    stream = _name("track")

    async def scenario() -> None:
        async with target.producer() as p:
            await p.create_stream(stream)
            await p.send_batch(stream, [b"%d" % i for i in range(20)])
        c = target.consumer()
        await c.start()
        try:
            with pytest.raises(Exception):  # noqa: B017 - rstream raises its OffsetNotFound
                await c.query_offset(stream, "reader")
            await c.store_offset(stream, "reader", 11)
            await _until_offset(c, stream, "reader", 11)
        finally:
            await c.close()
        resumed = await _read(target, stream, 3, ConsumerOffsetSpecification(OffsetType.OFFSET, 12))
        assert [m for _, m in resumed] == [b"12", b"13", b"14"]

    run_async(scenario(), 40)


def _with_id(body: bytes, publishing_id: int) -> AMQPMessage:
    m = AMQPMessage(body=body)
    m.publishing_id = publishing_id
    return m


async def _until_offset(c: Consumer, stream: str, name: str, want: int) -> None:
    deadline = time.monotonic() + 10
    while True:  # StoreOffset has no answer: poll QueryOffset until it shows
        try:
            if await c.query_offset(stream, name) == want:
                return
        except Exception:  # noqa: BLE001 - not stored yet
            pass
        assert time.monotonic() < deadline, "stored offset never showed"
        await asyncio.sleep(0.02)


def test_amqp_and_stream_clients_share_the_stream(target: Target, shared_broker: Broker) -> None:
    stream = _name("mixed")

    async def create() -> None:
        async with target.producer() as p:
            await p.create_stream(stream)
            await p.send_wait(stream, AMQPMessage(body=b"from-stream-client"))

    run_async(create(), 20)
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", stream, b"from-amqp", pika.BasicProperties(delivery_mode=2))
        ch.basic_qos(prefetch_count=10)
        got: list[bytes] = []
        ch.basic_consume(stream, lambda c, m, p, b: got.append(b), arguments={"x-stream-offset": "first"})
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            conn.process_data_events(0.1)
        assert got[1] == b"from-amqp" and got[0].endswith(b"from-stream-client")  # the AMQP 1.0 bytes
    finally:
        conn.close()
    both = run_async(_read(target, stream, 2, _first(), amqp_decoder), 20)
    assert bytes(both[1][1].body) == b"from-amqp"  # an AMQP 0-9-1 body arrives as a data section


def test_super_stream_routing_and_single_active_consumers(target: Target) -> None:
    ss = _name("orders")
    parts = [f"{ss}-0", f"{ss}-1", f"{ss}-2"]

    async def scenario() -> None:
        producer = SuperStreamProducer(target.host, **target.kw(), super_stream=ss, routing_extractor=_key,
                                       super_stream_creation_option=SuperStreamCreationOption(n_partitions=3))
        await producer.start()
        client = await producer.default_client
        assert await client.partitions(ss) == parts
        assert await client.route("1", ss) == [f"{ss}-1"]
        seen: dict[str, dict[str, list[int]]] = {"a": {}, "b": {}}
        active: dict[tuple[str, str], bool] = {}

        def handler(name: str) -> Callable[[Any, MessageContext], None]:
            def on_message(msg: AMQPMessage, ctx: MessageContext) -> None:
                seen[name].setdefault(ctx.stream, []).append(int(bytes(msg.body)))
            return on_message

        def listener(name: str) -> Callable[[bool, Any], Awaitable[OffsetSpecification]]:
            async def update(is_active: bool, ctx: Any) -> OffsetSpecification:
                active[(name, ctx.stream)] = is_active
                return OffsetSpecification(OffsetType.NEXT, 0)
            return update

        async def publish(first: int) -> None:
            for i in range(first, first + 30):
                await producer.send(AMQPMessage(body=b"%d" % i, application_properties={"k": str(i)}))

        consumers = []
        for name in ("a", "b"):
            c = SuperStreamConsumer(target.host, **target.kw(), super_stream=ss)
            await c.start()
            await c.subscribe(handler(name), decoder=amqp_decoder, consumer_update_listener=listener(name),
                              properties={"single-active-consumer": "true", "name": "group",
                                          "super-stream": ss})
            consumers.append(c)
        # partition i goes to the member at i modulo 2: a takes 0 and 2, b takes 1 (a lets it go)
        await _until(lambda: active.get(("b", parts[1])) is True and active.get(("a", parts[1])) is False,
                     15, "the group to split the partitions")
        await publish(0)
        await _until(lambda: sum(len(v) for s in seen.values() for v in s.values()) >= 30, 15,
                     "every message once over the group")
        assert set(seen["a"]) == {parts[0], parts[2]} and set(seen["b"]) == {parts[1]}, seen
        assert sorted(n for s in seen.values() for v in s.values() for n in v) == list(range(30))
        # b leaves: a takes partition 1 over; what is published next reaches a on every partition
        await consumers[1].close()
        await _until(lambda: active.get(("a", parts[1])) is True, 15, "a to take partition 1 over")
        await publish(30)
        await _until(lambda: sum(len(v) for v in seen["a"].values()) >= 20 + 30, 15,
                     "the remaining consumer to get every new message")
        assert set(seen["a"]) == set(parts)
        assert sorted(n for v in seen["a"].values() for n in v if n >= 30) == list(range(30, 60))
        await consumers[0].close()
        await producer.close()
        async with SuperStreamProducer(target.host, **target.kw(), super_stream=ss,
                                       routing_extractor=_key) as p:
            await p.delete_super_stream(ss)
            assert not await (await p.default_client).stream_exists(parts[0])

    run_async(scenario(), 60)


async def _key(msg: AMQPMessage) -> str:
    return str(msg.application_properties["k"])


def test_credit_bounds_chunks_in_flight(target: Target, shared_broker: Broker) -> None:
    """One credit, one chunk: the next arrives only after a Credit frame (raw client)."""
    stream = _name("credit")

    async def create() -> None:
        async with target.producer() as p:
            await p.create_stream(stream)

    run_async(create(), 20)
    conn = connect(shared_broker)
    ch = conn.channel()
    ch.confirm_delivery()
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, target.password) == C.OK
        body = bytes([1]) + s16(stream) + struct.pack(">H", C.OFFSET_NEXT) + struct.pack(">H", 1)
        assert w.request(C.SUBSCRIBE, body + struct.pack(">i", 0)) == C.OK
        ch.basic_publish("", stream, b"one", pika.BasicProperties(delivery_mode=2))
        first = w.expect(C.DELIVER)
        assert first[0] == 1 and struct.unpack_from(">H", first, 3)[0] == 1
        ch.basic_publish("", stream, b"two", pika.BasicProperties(delivery_mode=2))
        with pytest.raises(TimeoutError):  # no credit left: nothing more
            w.expect(C.DELIVER, timeout=0.5)
        w.send(frame(C.CREDIT, bytes([1]) + struct.pack(">H", 10)))
        rest = w.expect(C.DELIVER)
        assert struct.unpack_from(">Q", rest, 1 + 1 + 1 + 2 + 4 + 8 + 8)[0] == 1  # chunk's first offset
        assert rest.endswith(b"two")
        w.send(frame(C.CREDIT, bytes([9]) + struct.pack(">H", 1)))  # unknown subscription
        answer = w.expect(C.CREDIT | C.RESPONSE)
        assert struct.unpack(">HB", answer) == (C.SUBSCRIPTION_ID_DOES_NOT_EXIST, 9)
        ch.queue_delete(stream)  # deleted under a subscription: MetadataUpdate, stream not available
        assert w.expect(C.METADATA_UPDATE) == struct.pack(">H", C.STREAM_NOT_AVAILABLE) + s16(stream)
    finally:
        w.close()
        conn.close()


def test_permissions_and_bad_login(target: Target, broker_mode: str) -> None:
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, "wrong-password") == C.AUTHENTICATION_FAILURE
    finally:
        w.close()
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, target.password, vhost="no-such-vhost") == C.VHOST_ACCESS_FAILURE
    finally:
        w.close()
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, target.password) == C.OK
        assert w.request(C.CREATE, s16("") + struct.pack(">i", 0)) == C.PRECONDITION_FAILED  # no name
        assert w.request(C.CREATE, s16("amq.reserved") + struct.pack(">i", 0)) == C.PRECONDITION_FAILED
        missing = _name("missing")
        assert w.request(C.DECLARE_PUBLISHER, bytes([0]) + s16("") + s16(missing)) == C.STREAM_DOES_NOT_EXIST
        meta = w.next_corr()
        w.send(frame(C.METADATA, struct.pack(">Ii", meta, 1) + s16(missing)))
        payload = w.expect(C.METADATA | C.RESPONSE)
        assert payload.endswith(s16(missing) + struct.pack(">HHi", C.STREAM_DOES_NOT_EXIST, 0xFFFF, 0))
    finally:
        w.close()


def _api(b: Any, method: str, path: str) -> tuple[int, Any]:
    url = urlparse(b.url)
    req = urllib.request.Request(f"http://{b.host}:{b.mgmt_port}{path}", method=method)
    auth = f"{url.username or 'guest'}:{url.password or 'guest'}".encode()
    req.add_header("Authorization", "Basic " + base64.b64encode(auth).decode())
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.strip() else None
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _listed(b: Any, name: str) -> dict[str, Any] | None:
    status, conns = _api(b, "GET", "/api/connections")
    assert status == 200
    found = [c for c in conns if c["client_properties"].get("connection_name") == name]
    return found[0] if found else None


def test_connections_and_consumers_in_the_api_closable(target: Target, shared_broker: Broker,
                                                       broker_mode: str) -> None:
    """A stream connection is listed as RabbitMQ's stream plugin lists it, its subscription is a
    consumer, its messages are counted, and DELETE closes it with a Close carrying the reason."""
    stream, name = _name("api"), _name("conn")
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, target.password, properties={"connection_name": name}) == C.OK
        assert w.request(C.CREATE, s16(stream) + struct.pack(">i", 0)) == C.OK
        assert w.request(C.DECLARE_PUBLISHER, bytes([1]) + s16("") + s16(stream)) == C.OK
        msgs = b"".join(struct.pack(">QI", i, 2) + b"m%d" % i for i in range(3))
        w.send(frame(C.PUBLISH, bytes([1]) + struct.pack(">i", 3) + msgs))
        w.expect(C.PUBLISH_CONFIRM)
        sub = struct.pack(">B", 7) + s16(stream) + struct.pack(">HHi", C.OFFSET_FIRST, 10, 0)
        assert w.request(C.SUBSCRIBE, sub) == C.OK
        w.expect(C.DELIVER)
        conn = _listed(shared_broker, name)
        assert conn is not None
        assert conn["protocol"] == "RabbitMQ Stream" and conn["vhost"] == "/" and conn["user"] == target.user
        assert conn["channels"] == 0 and conn["recv_cnt"] >= 5 and conn["send_oct"] > 0
        assert conn["peer_port"] == w.sock.getsockname()[1]  # the client's, through a follower too
        status, consumers = _api(shared_broker, "GET", "/api/consumers")
        assert status == 200
        mine = [c for c in consumers if c["queue"]["name"] == stream]
        assert len(mine) == 1 and mine[0]["channel_details"]["connection_name"] == conn["name"]
        if broker_mode == "single":  # the session cluster's nodes serve no metrics port
            with urllib.request.urlopen(f"http://{shared_broker.host}:{shared_broker.metrics_port}/metrics",
                                        timeout=10) as r:
                text = r.read().decode()
            got = re.search(r'^rabbitmq_global_messages_received_total\{protocol="stream"\} ([0-9.e+]+)$',
                            text, re.M)
            assert got is not None and float(got.group(1)) >= 3
        quoted = urllib.parse.quote(conn["name"], safe="")
        assert _api(shared_broker, "DELETE", f"/api/connections/{quoted}")[0] == 204
        close = w.expect(C.CLOSE)
        assert b"Closed via management plugin" in close
        assert _listed(shared_broker, name) is None
    finally:
        w.close()


def test_stream_plugin_api_connections_publishers_consumers(target: Target, shared_broker: Broker) -> None:
    """RabbitMQ's stream management paths: ``/api/stream/connections`` (by vhost, one by name,
    its publishers and consumers, DELETE), ``/api/stream/publishers`` (by vhost and stream) and
    ``/api/stream/consumers``, with rstream's named publisher and a subscription."""
    stream, name, ref = _name("sapi"), _name("sconn"), _name("ref")
    got: list[int] = []

    async def scenario() -> None:
        kw = {**target.kw(), "connection_name": name}
        async with Producer(target.host, **kw) as p:
            await p.create_stream(stream)
            for i in range(3):
                await p.send_wait(stream, b"m%d" % i, publisher_name=ref)
            c = Consumer(target.host, **kw)
            await c.start()
            try:
                await c.subscribe(stream, lambda _m, ctx: got.append(ctx.offset),
                                  offset_specification=_first(), properties={"app": "api-test"})
                await _until(lambda: len(got) >= 3, 10, "3 deliveries")
                await asyncio.to_thread(_check_stream_api, shared_broker, stream, name, ref)
            finally:
                await c.close()
            await p.delete_stream(stream)

    run_async(scenario(), 60)
    w = StreamWire(target.host, target.port)
    try:  # DELETE closes a stream connection with a Close carrying the reason
        assert w.handshake(target.user, target.password, properties={"connection_name": name}) == C.OK
        status, conns = _api(shared_broker, "GET", "/api/stream/connections")
        (conn,) = [c for c in conns if c["client_properties"].get("connection_name") == name]
        quoted = urllib.parse.quote(conn["name"], safe="")
        assert _api(shared_broker, "DELETE", f"/api/stream/connections/%2F/{quoted}")[0] == 204
        assert b"Closed via management plugin" in w.expect(C.CLOSE)
        assert _api(shared_broker, "GET", f"/api/stream/connections/%2F/{quoted}")[0] == 404
    finally:
        w.close()


def _check_stream_api(b: Broker, stream: str, name: str, ref: str) -> None:
    status, conns = _api(b, "GET", "/api/stream/connections")
    assert status == 200 and conns and all(c["protocol"] == "RabbitMQ Stream" for c in conns)
    mine = [c for c in conns if c["client_properties"].get("connection_name") == name]
    assert mine and all(c["vhost"] == "/" for c in mine)
    assert _api(b, "GET", "/api/stream/connections/%2F")[1] == conns
    status, pubs = _api(b, "GET", f"/api/stream/publishers/%2F/{stream}")
    assert status == 200 and len(pubs) == 1, pubs
    pub = pubs[0]
    assert pub["reference"] == ref and pub["queue"] == {"name": stream, "vhost": "/"}
    assert (pub["published"], pub["confirmed"], pub["errored"]) == (3, 3, 0)
    assert set(pub["connection_details"]) == {"name", "user", "node", "peer_host", "peer_port"}
    assert pub in _api(b, "GET", "/api/stream/publishers")[1]
    assert pub in _api(b, "GET", "/api/stream/publishers/%2F")[1]
    status, consumers = _api(b, "GET", "/api/stream/consumers/%2F")
    sub = [c for c in consumers if c["queue"]["name"] == stream]
    assert status == 200 and len(sub) == 1, consumers
    assert sub[0]["consumed"] == 3 and sub[0]["offset"] == 3 and sub[0]["properties"]["app"] == "api-test"
    assert sub[0]["active"] is True and sub[0]["activity_status"] == "up"
    assert isinstance(sub[0]["credits"], int)
    sub_conn = urllib.parse.quote(sub[0]["connection_details"]["name"], safe="")
    pub_conn = urllib.parse.quote(pub["connection_details"]["name"], safe="")
    status, one = _api(b, "GET", f"/api/stream/connections/%2F/{sub_conn}")
    assert status == 200 and one["name"] == sub[0]["connection_details"]["name"]
    assert _api(b, "GET", f"/api/stream/connections/%2F/{sub_conn}/consumers")[1] == sub
    assert _api(b, "GET", f"/api/stream/connections/%2F/{pub_conn}/publishers")[1] == [pub]
    assert _api(b, "GET", "/api/stream/connections/%2F/no-such-connection")[0] == 404
    assert _api(b, "GET", "/api/stream/publishers/%2F/no-such-stream")[0] == 404
    assert _api(b, "GET", "/api/stream/consumers/no-such-vhost")[0] == 404


def test_deliver_version_2_for_a_client_that_asks(target: Target) -> None:
    """A client listing Deliver up to version 2 in ExchangeCommandVersions gets Deliver version 2:
    the committed chunk id (the first offset of the last chunk stored) after the subscription id,
    then the chunk as in version 1 (frames written by hand: rstream speaks version 1 only)."""
    stream = _name("dv2")
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, target.password) == C.OK
        corr = w.next_corr()
        ask = struct.pack(">Ii", corr, 1) + struct.pack(">HHH", C.DELIVER, 1, 2)
        w.send(frame(C.EXCHANGE_COMMAND_VERSIONS, ask))
        answer = w.expect(C.EXCHANGE_COMMAND_VERSIONS | C.RESPONSE)
        (count,) = struct.unpack_from(">i", answer, 6)
        versions = {k: (lo, hi) for k, lo, hi in struct.iter_unpack(">HHH", answer[10:10 + 6 * count])}
        assert versions[C.DELIVER] == (1, 2)
        assert w.request(C.CREATE, s16(stream) + struct.pack(">i", 0)) == C.OK
        assert w.request(C.DECLARE_PUBLISHER, bytes([1]) + s16("") + s16(stream)) == C.OK
        for batch in (range(3), range(3, 5)):  # two chunks stored: offsets 0-2, then 3-4
            msgs = b"".join(struct.pack(">QI", i, 2) + b"m%d" % i for i in batch)
            w.send(frame(C.PUBLISH, bytes([1]) + struct.pack(">i", len(batch)) + msgs))
            w.expect(C.PUBLISH_CONFIRM)
        sub = struct.pack(">B", 3) + s16(stream) + struct.pack(">HHi", C.OFFSET_FIRST, 10, 0)
        assert w.request(C.SUBSCRIBE, sub) == C.OK
        got = w.read()
        assert got is not None and got[0] == C.DELIVER and got[1] == 2, got
        payload = got[2]
        sub_id, committed, magic = struct.unpack_from(">BQB", payload)
        assert (sub_id, committed, magic) == (3, 3, C.CHUNK_MAGIC_VERSION)
        # then version 1's chunk: type, entries, records, timestamp, epoch, first offset, ...
        (n_entries,) = struct.unpack_from(">H", payload, 11)
        (first_offset,) = struct.unpack_from(">Q", payload, 33)
        assert first_offset == 0 and n_entries >= 3
    finally:
        w.close()


def _sub_entry(records: list[bytes], gzip_it: bool) -> bytes:
    """A sub-entry as the clients build it: records size-prefixed, gzip-compressed or not."""
    raw = b"".join(struct.pack(">I", len(r)) + r for r in records)
    data = gzip.compress(raw) if gzip_it else raw
    return struct.pack(">BHII", 0x80 | (int(gzip_it) << 4), len(records), len(raw), len(data)) + data


def test_sub_entry_batches_plain_and_gzip_with_dedup(target: Target) -> None:
    """rstream's sub-entry batching (no compression and gzip) stores each record as a message
    and confirms each batch once; a batch resent under its publishing id adds nothing; other
    compressions and a sub-entry whose size lies are refused with code 17, nothing stored."""
    stream = _name("subentry")
    confirmed: list[Any] = []

    async def scenario() -> None:
        async with target.producer() as p:
            await p.create_stream(stream)
            await p.send_sub_entry(stream, [AMQPMessage(body=b"plain-%d" % i) for i in range(3)],
                                   compression_type=CompressionType.No, on_publish_confirm=confirmed.append)
            await p.send_sub_entry(stream, [AMQPMessage(body=b"gzip-%d" % i) for i in range(4)],
                                   compression_type=CompressionType.Gzip, on_publish_confirm=confirmed.append)
            await _until(lambda: len(confirmed) == 2, 15, "two sub-entry confirms")
        got = await _read(target, stream, 7, _first(), amqp_decoder)
        assert [bytes(m.body) for _, m in got] == [b"plain-0", b"plain-1", b"plain-2"] + \
            [b"gzip-%d" % i for i in range(4)]
        assert [o for o, _ in got] == list(range(7))

    run_async(scenario(), 40)
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, target.password) == C.OK
        assert w.request(C.DECLARE_PUBLISHER, bytes([2]) + s16("wire") + s16(stream)) == C.OK
        batch = struct.pack(">Q", 1) + _sub_entry([b"w1", b"w2"], True)
        for _ in range(2):  # the second is a duplicate of publishing id 1: confirmed, not stored
            w.send(frame(C.PUBLISH, bytes([2]) + struct.pack(">i", 1) + batch))
            assert w.expect(C.PUBLISH_CONFIRM) == bytes([2]) + struct.pack(">iQ", 1, 1)
        assert w.request(C.QUERY_PUBLISHER_SEQUENCE, s16("wire") + s16(stream)) == C.OK
    finally:
        w.close()
    got = run_async(_read(target, stream, 9, _first()), 30)  # raw bytes: w1, w2 are not AMQP 1.0
    assert [bytes(m) for _, m in got][7:] == [b"w1", b"w2"]
    for bad in (struct.pack(">BHII", 0x80 | (3 << 4), 1, 6, 6) + struct.pack(">I", 2) + b"xx",  # lz4
                struct.pack(">BHII", 0x80 | (1 << 4), 1, 1 << 30, 4) + b"\x1f\x8b\x08\x00",  # a bomb
                struct.pack(">BHII", 0x80, 2, 6, 6) + struct.pack(">I", 2) + b"xx"):  # 2 records, 1 there
        w = StreamWire(target.host, target.port)
        try:
            assert w.handshake(target.user, target.password) == C.OK
            assert w.request(C.DECLARE_PUBLISHER, bytes([1]) + s16("") + s16(stream)) == C.OK
            w.send(frame(C.PUBLISH, bytes([1]) + struct.pack(">iQ", 1, 5) + bad))
            close = w.expect(C.CLOSE)
            assert struct.unpack_from(">H", close, 4)[0] == C.PRECONDITION_FAILED
        finally:
            w.close()

    async def nothing_past_nine() -> None:
        consumer = target.consumer()
        await consumer.start()
        try:
            extra: list[Any] = []
            await consumer.subscribe(stream, lambda m, _c: extra.append(m),
                                     offset_specification=ConsumerOffsetSpecification(OffsetType.OFFSET, 9))
            await asyncio.sleep(0.3)  # a refused batch stored anyway would arrive within this window
            assert extra == []
        finally:
            await consumer.close()

    run_async(nothing_past_nine(), 20)


def _text(b: Any, path: str) -> str:
    url = urlparse(b.url)
    req = urllib.request.Request(f"http://{b.host}:{b.mgmt_port}{path}")
    auth = f"{url.username or 'guest'}:{url.password or 'guest'}".encode()
    req.add_header("Authorization", "Basic " + base64.b64encode(auth).decode())
    with urllib.request.urlopen(req, timeout=15) as resp:
        return str(resp.read().decode())


def _lags(b: Any, stream: str) -> tuple[list[int], str]:
    """The ``offset_lag`` of each subscription to ``stream`` in ``/api/stream/consumers``, and
    the per-object metrics' text."""
    status, consumers = _api(b, "GET", "/api/stream/consumers/%2F")
    assert status == 200
    return ([c.get("offset_lag", -1) for c in consumers if c["queue"]["name"] == stream],
            _text(b, "/metrics/per-object"))


def test_offset_lag_in_the_api_and_metrics(target: Target, shared_broker: Broker) -> None:
    """RabbitMQ 3.11's ``offset_lag`` in ``/api/stream/consumers`` (messages stored past what the
    subscription was sent) and the lag per stream (partition) and consumer name in
    ``/metrics/per-object``, as Kafka's tools show a group's lag: a subscription out of credit
    lags by what is published after it; given credit, it catches up to 0."""
    stream, consumer = _name("lag"), _name("group")
    w = StreamWire(target.host, target.port)

    def publish(ids: range) -> None:
        msgs = b"".join(struct.pack(">QI", i, 2) + b"m%d" % (i % 10) for i in ids)
        w.send(frame(C.PUBLISH, bytes([1]) + struct.pack(">i", len(ids)) + msgs))
        w.expect(C.PUBLISH_CONFIRM)

    try:
        assert w.handshake(target.user, target.password) == C.OK
        assert w.request(C.CREATE, s16(stream) + struct.pack(">i", 0)) == C.OK
        assert w.request(C.DECLARE_PUBLISHER, bytes([1]) + s16("") + s16(stream)) == C.OK
        publish(range(4))
        props = struct.pack(">i", 1) + s16("name") + s16(consumer)
        sub = struct.pack(">B", 5) + s16(stream) + struct.pack(">HH", C.OFFSET_FIRST, 1) + props
        assert w.request(C.SUBSCRIBE, sub) == C.OK
        assert w.expect(C.DELIVER)  # its one credit spent on the chunk of offsets 0-3
        publish(range(4, 11))  # 7 more: not sent, no credit
        labels = re.escape(f'{{consumer="{consumer}",stream="{stream}",vhost="/"}}')
        series = re.compile(r"^skred_stream_consumer_offset_lag" + labels + r" ([0-9.e+]+)$", re.M)
        lags, text = _lags(shared_broker, stream)
        assert lags == [7], lags
        got = series.search(text)
        assert got is not None and float(got.group(1)) == 7, text[-2000:]
        w.send(frame(C.CREDIT, struct.pack(">BH", 5, 10)))
        w.expect(C.DELIVER)
        deadline = time.monotonic() + 10
        while (lags := _lags(shared_broker, stream))[0] != [0]:
            assert time.monotonic() < deadline, lags[0]
            time.sleep(0.05)  # poll interval, bounded by the deadline
        got = series.search(lags[1])
        assert got is not None and float(got.group(1)) == 0
        assert w.request(C.UNSUBSCRIBE, bytes([5])) == C.OK
        assert w.request(C.DELETE, s16(stream)) == C.OK
    finally:
        w.close()


def test_spark_amqp_reader_reads_a_last_chunk_of_many(target: Target, shared_broker: Broker) -> None:
    """The Spark source's AMQP mode (``broker/spark/amqp.py``) finds a stream's extent and reads
    all of it when the last chunk holds several messages (one Publish frame stores one chunk; a
    sink's window of publishes does the same): ``last`` names the first offset of that chunk, not
    the last message, so an extent taken from it came up short."""
    from broker.spark import amqp as spark_amqp

    stream = _name("extent")
    w = StreamWire(target.host, target.port)
    try:
        assert w.handshake(target.user, target.password) == C.OK
        assert w.request(C.CREATE, s16(stream) + struct.pack(">i", 0)) == C.OK
        assert w.request(C.DECLARE_PUBLISHER, bytes([1]) + s16("") + s16(stream)) == C.OK
        for ids in (range(2), range(2, 9)):  # two chunks: offsets 0-1, then 2-8
            msgs = b"".join(struct.pack(">QI", i, 2) + b"e%d" % i for i in ids)
            w.send(frame(C.PUBLISH, bytes([1]) + struct.pack(">i", len(ids)) + msgs))
            w.expect(C.PUBLISH_CONFIRM)
        assert spark_amqp.extent(shared_broker.url, stream) == (0, 9)
        got = list(spark_amqp.read_range(shared_broker.url, stream, 0, 9, timeout=10))
        assert [(r[0], r[5]) for r in got] == [(i, b"e%d" % i) for i in range(9)]
        assert w.request(C.DELETE, s16(stream)) == C.OK
    finally:
        w.close()
