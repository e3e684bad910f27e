"""Bounded fuzz of malformed stream-protocol frames against a real broker (chaos group), and the
stream protocol's confirms across kill -9.

Theory of operation: each example opens a connection, optionally gets through the handshake to
an open vhost, and sends one complete frame that is wrong in one way: a known command's valid
fields cut short or followed by garbage, random bytes under a known or unknown key, a response
key a client never sends, a size above the frame limit. Then a barrier request (PeerProperties
before the login, Metadata after it) whose answer must come back, unless the server closed the
connection, in which case its last frame must be a Close with one of the protocol's response
codes. The broker must log no traceback, and rstream must still publish and consume afterwards.
``SKRED_CHAOS_FUZZ_EXAMPLES`` sets the number of examples (CI runs the small default).
"""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rstream import AMQPMessage, Consumer, ConsumerOffsetSpecification, OffsetType, Producer, amqp_decoder

from broker.streamproto import codec as C

from ._stream_wire import StreamWire, frame, s16
from ._support import SkredProcess, free_port, is_external, run_async, unique
from ._tls import make_pki, tls_args
from .test_features_extra import http

pytestmark = pytest.mark.chaos

EXAMPLES = int(os.environ.get("SKRED_CHAOS_FUZZ_EXAMPLES", "60"))
_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))
_CODES = set(range(C.OK, C.NO_OFFSET + 1))

# Valid payloads of the commands a client sends (correlation id 7 where there is one).
_VALID: dict[int, bytes] = {
    C.DECLARE_PUBLISHER: struct.pack(">IB", 7, 1) + s16("ref") + s16("fz"),
    C.PUBLISH: bytes([1]) + struct.pack(">iQi", 1, 1, 3) + b"abc",
    C.QUERY_PUBLISHER_SEQUENCE: struct.pack(">I", 7) + s16("ref") + s16("fz"),
    C.DELETE_PUBLISHER: struct.pack(">IB", 7, 1),
    C.SUBSCRIBE: struct.pack(">IB", 7, 1) + s16("fz") + struct.pack(">HQH", C.OFFSET_OFFSET, 0, 5)
    + struct.pack(">i", 0),
    C.CREDIT: struct.pack(">BH", 1, 5),
    C.STORE_OFFSET: s16("ref") + s16("fz") + struct.pack(">Q", 1),
    C.QUERY_OFFSET: struct.pack(">I", 7) + s16("ref") + s16("fz"),
    C.UNSUBSCRIBE: struct.pack(">IB", 7, 1),
    C.CREATE: struct.pack(">I", 7) + s16("fz-new") + struct.pack(">i", 1) + s16("max-age") + s16("1h"),
    C.DELETE: struct.pack(">I", 7) + s16("fz-gone"),
    C.METADATA: struct.pack(">Ii", 7, 1) + s16("fz"),
    C.ROUTE: struct.pack(">I", 7) + s16("k") + s16("fz-super"),
    C.PARTITIONS: struct.pack(">I", 7) + s16("fz-super"),
    C.EXCHANGE_COMMAND_VERSIONS: struct.pack(">Ii", 7, 1) + struct.pack(">HHH", 2, 1, 2),
    C.CREATE_SUPER_STREAM: struct.pack(">I", 7) + s16("fz-ss") + struct.pack(">i", 1) + s16("fz-ss-a")
    + struct.pack(">i", 1) + s16("a") + struct.pack(">i", 0),
    C.DELETE_SUPER_STREAM: struct.pack(">I", 7) + s16("fz-ss"),
    C.PEER_PROPERTIES: struct.pack(">Ii", 7, 1) + s16("product") + s16("fuzz"),
    C.SASL_HANDSHAKE: struct.pack(">I", 7),
    C.SASL_AUTHENTICATE: struct.pack(">I", 7) + s16("PLAIN") + struct.pack(">i", 12) + b"\0guest\0guest",
    C.TUNE: struct.pack(">II", 1 << 20, 60),
    C.OPEN: struct.pack(">I", 7) + s16("/"),
    C.CLOSE: struct.pack(">IH", 7, 1) + s16("bye"),
    C.HEARTBEAT: b"",
}


@st.composite
def _bad_frame(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["cut", "tail", "random", "unknown", "response", "flip", "oversize",
                                 "short"]))
    key = draw(st.sampled_from(sorted(_VALID)))
    valid = _VALID[key]
    if kind == "cut":
        return frame(key, valid[: draw(st.integers(0, max(len(valid) - 1, 0)))])
    if kind == "tail":
        return frame(key, valid + draw(st.binary(min_size=1, max_size=16)))
    if kind == "random":
        return frame(key, draw(st.binary(max_size=64)), draw(st.sampled_from([1, 2, 3, 0xFFFF])))
    if kind == "unknown":
        return frame(draw(st.integers(31, 0x7FFF)), draw(st.binary(max_size=32)))
    if kind == "response":
        return frame(key | C.RESPONSE, draw(st.binary(max_size=32)))
    if kind == "flip":
        data = bytearray(valid or b"\0")
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
        return frame(key, bytes(data))
    if kind == "oversize":
        return struct.pack(">IHH", draw(st.integers(2 << 20, 0xFFFFFFFF)), key, 1)
    return struct.pack(">I", draw(st.integers(0, 3))) + b"\0" * 4  # size below key + version


@pytest.fixture(scope="module")
def fuzz_broker(tmp_path_factory: pytest.TempPathFactory) -> SkredProcess:
    if is_external():
        pytest.skip("starts its own broker")
    b = SkredProcess(tmp_path_factory.mktemp("stream-fuzz") / "data")
    b.start()
    yield b  # type: ignore[misc]
    b.close()


def _outcome(w: StreamWire, barrier: int) -> None:
    """The barrier's answer arrives, or the connection ends after a Close with a known code."""
    last_close = None
    while True:
        got = w.read(timeout=5)
        if got is None:
            assert last_close is None or last_close in _CODES, f"closed with code {last_close}"
            return
        key, _version, payload = got
        if key == C.CLOSE:
            last_close = struct.unpack_from(">H", payload, 4)[0]
        if key == barrier | C.RESPONSE and payload[:4] == struct.pack(">I", 99):
            return


@pytest.mark.timeout(60 + EXAMPLES // 5)
@given(open_first=st.booleans(), bad=_bad_frame())
@_SETTINGS
def test_malformed_frames_get_an_answer_never_a_crash(fuzz_broker: SkredProcess, open_first: bool,
                                                      bad: bytes) -> None:
    w = StreamWire(fuzz_broker.host, fuzz_broker.stream_port)
    try:
        if open_first:
            assert w.handshake() == C.OK
            barrier = C.METADATA
            w.send(bad + frame(C.METADATA, struct.pack(">Ii", 99, 1) + s16("fz")))
        else:
            barrier = C.PEER_PROPERTIES
            w.send(bad + frame(C.PEER_PROPERTIES, struct.pack(">Ii", 99, 0)))
        _outcome(w, barrier)
    finally:
        w.close()


async def _round_trip(host: str, kw: dict[str, Any], stream: str, body: bytes) -> list[bytes]:
    """Create ``stream``, publish ``body`` (confirmed), read the stream from the first offset."""
    async with Producer(host, **kw) as p:
        await p.create_stream(stream)
        await p.send_wait(stream, body)
    got: list[bytes] = []
    c = Consumer(host, **kw)
    await c.start()
    await c.subscribe(stream, lambda m, _c: got.append(m),
                      offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None))
    for _ in range(500):  # bounded poll
        if got:
            break
        await asyncio.sleep(0.02)
    await c.close()
    return got


def test_after_the_fuzz_no_traceback_and_clients_still_work(fuzz_broker: SkredProcess) -> None:
    stream = unique("after-fuzz")

    kw = {"port": fuzz_broker.stream_port, "username": "guest", "password": "guest"}
    got = run_async(_round_trip(fuzz_broker.host, kw, stream, b"still here"), 30)
    assert got == [b"still here"]
    status, overview = http(fuzz_broker, "GET", "/api/overview")  # the listener, as RabbitMQ lists it
    assert status == 200 and {"node": overview["node"], "protocol": "stream", "ip_address": "127.0.0.1",
                               "port": fuzz_broker.stream_port} in overview["listeners"]
    log = fuzz_broker.log_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


def test_confirmed_messages_and_publisher_sequence_survive_kill9(broker: SkredProcess) -> None:
    """Every confirmed stream-protocol message, its publisher's sequence and a stored offset are
    there after kill -9 (own broker: it is killed)."""
    stream = unique("durable")
    kw = {"port": broker.stream_port, "username": "guest", "password": "guest"}

    async def publish() -> None:
        async with Producer(broker.host, **kw) as p:
            await p.create_stream(stream)
            c = await p.default_client
            for i in range(1, 41):
                if i == 40:  # the last confirm covers the stream's sync, offsets file included
                    await c.store_offset(stream, "reader", 17)
                m = AMQPMessage(body=b"%d" % i)
                m.publishing_id = i
                await p.send_wait(stream, m, publisher_name="durable-app")  # returns once confirmed

    async def after() -> tuple[int, int, list[bytes]]:
        async with Producer(broker.host, **kw) as p:
            c = await p.default_client
            seq = await c.query_publisher_sequence(stream, "durable-app")
        got: list[bytes] = []
        consumer = Consumer(broker.host, **kw)
        await consumer.start()
        offset = await consumer.query_offset(stream, "reader")
        await consumer.subscribe(stream, lambda m, _c: got.append(bytes(amqp_decoder(m).body)),
                                 offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None))
        for _ in range(500):
            if len(got) >= 40:
                break
            await asyncio.sleep(0.02)
        await consumer.close()
        return seq, offset, got

    run_async(publish(), 30)
    broker.kill9()
    broker.start()
    seq, offset, got = run_async(after(), 30)
    assert got == [b"%d" % i for i in range(1, 41)]
    assert seq == 40 and offset == 17


def test_tls_listener(tmp_path: Path) -> None:
    """The stream protocol over TLS on ``[stream] tls_port`` (5551 by default): rstream with an
    SSL context publishes and consumes, and /api/overview lists ``stream/ssl``; and on
    ``[stream] unix_path``."""
    if is_external():
        pytest.skip("starts its own broker")
    pki = make_pki(tmp_path / "pki")
    port = free_port()
    unix = tmp_path / "stream.sock"
    b = SkredProcess(tmp_path / "data", tls_args(pki, "--stream-tls-port", str(port),
                                                 "--stream-unix-path", str(unix),
                                                 "--amqp-tls-port", str(free_port()),
                                                 "--mgmt-tls-port", str(free_port())))
    try:
        b.start()
        stream = unique("tls")
        kw = {"port": port, "username": "guest", "password": "guest", "ssl_context": pki.client_context()}

        assert run_async(_round_trip("localhost", kw, stream, b"over tls"), 30) == [b"over tls"]
        w = StreamWire("", 0, unix_path=str(unix))  # and on the Unix socket, as the same users
        try:
            assert w.handshake() == C.OK
            assert w.request(C.DECLARE_PUBLISHER, bytes([0]) + s16("") + s16(stream)) == C.OK
        finally:
            w.close()
        status, overview = http(b, "GET", "/api/overview")
        assert status == 200 and any(lst["protocol"] == "stream/ssl" and lst["port"] == port
                                     for lst in overview["listeners"])
    finally:
        b.close()
