"""The remote AMQP ends. A source settles in batches: one ``basic.ack`` (``multiple``) covers a quarter of
the prefetch window, a lone settled message is acked within ``ACK_DELAY``, and closing writes
every ack that is due (so nothing settled is requeued: no duplicate after ``src-delete-after``).

The source end (``AmqpSource``) runs in the test process against a real Skred broker over a real
socket; its channel's ``basic_ack`` is wrapped to count the acks written. The destination
(``AmqpDestination``) runs in the test process too: a turn's publishes go out in one write and
are confirmed by delivery-tag range, the property bytes passed through unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiormq
import pytest
from pamqp import commands

from broker import properties
from broker.shovel.amqp_dest import AmqpDestination
from broker.shovel.amqp_source import ACK_DELAY, AmqpSource
from broker.shovel.definition import parse
from broker.shovel.ends import EndLost, Message, Settle, Verdict

from ._shovel import publish
from ._support import SkredProcess, free_port, unique
from ._tls import make_pki, tls_args


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = SkredProcess(tmp_path_factory.mktemp("shovel-acks") / "data")
    b.start()
    yield b
    b.close()


async def _ready_count(url: str, queue: str) -> int:
    conn = await aiormq.connect(url)
    try:
        ch = await conn.channel()
        ok = await ch.queue_declare(queue, passive=True)
        return ok.message_count or 0
    finally:
        await conn.close()


async def _run(url: str, queue: str, n: int, prefetch: int, settle_first: int,
               at_once: bool = False) -> tuple[int, int, float, float]:
    """Consume ``n``, settle the first ``settle_first`` (``at_once``: each as it arrives, as the
    link does for a destination that takes it at once); the acks written, how many were written
    before the last settle, the seconds until the last settle's ack was written, and the seconds
    from the first delivery to the last settle."""
    d = parse("/", "t", {"src-uri": url, "src-queue": queue, "dest-uri": "amqp://", "dest-queue": "x",
                         "src-prefetch-count": prefetch})
    src = AmqpSource(d, unique("tag"), {})
    got: list[Message] = []
    arrived = asyncio.Event()
    acks: list[float] = []

    first: list[float] = []

    def on_message(m: Message) -> None:
        if not first:
            first.append(time.monotonic())
        got.append(m)
        if at_once and len(got) < settle_first:
            src.settle(m.tag, Settle.ACK)
        if len(got) >= min(n, prefetch):
            arrived.set()

    await src.open(on_message)
    assert src.wire is not None
    real = src.wire.write

    def counted(channel: int, method: Any) -> None:
        if isinstance(method, commands.Basic.Ack):
            acks.append(time.monotonic())
        real(channel, method)

    src.wire.write = counted  # type: ignore[method-assign]
    await asyncio.wait_for(arrived.wait(), 30)
    for m in [] if at_once else got[:settle_first - 1]:
        src.settle(m.tag, Settle.ACK)
    await asyncio.sleep(0)
    before = len(acks)
    t0 = time.monotonic()
    elapsed = t0 - first[0]
    src.settle(got[settle_first - 1].tag, Settle.ACK)  # the last one, alone (when below a batch)
    deadline = time.monotonic() + 5
    while len(acks) == before and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    lone = acks[-1] - t0 if len(acks) > before else float("inf")
    written = len(acks)
    await src.close()
    return written, before, lone, elapsed


def test_a_window_of_settles_is_a_few_multiple_acks(broker: SkredProcess) -> None:
    queue = unique("acks-batch")
    publish(broker.url, queue, "m", 1000, declare={})
    written, _, _, elapsed = asyncio.run(_run(broker.url, queue, 1000, 1000, 1000, at_once=True))
    # each ack is a full batch (250: a quarter of the prefetch) or the timer's, at most one per
    # ACK_DELAY, however slowly this loaded machine delivered them
    most = 1000 // 250 + int(elapsed / ACK_DELAY) + 2
    assert written <= most, f"{written} basic.ack frames for 1000 settled messages in {elapsed:.2f} s"
    assert asyncio.run(_ready_count(broker.url, queue)) == 0  # every one acked, none requeued


def test_a_lone_settle_is_acked_promptly_and_close_writes_what_is_due(broker: SkredProcess) -> None:
    queue = unique("acks-lone")
    publish(broker.url, queue, "m", 10, declare={})
    written, before, lone, _ = asyncio.run(_run(broker.url, queue, 10, 1000, 3))
    assert lone < 1.0, f"a lone settle waited {lone:.3f} s for its ack"
    assert written >= 1
    assert asyncio.run(_ready_count(broker.url, queue)) == 7  # the 7 unsettled were given back


async def _publish_odd(url: str, queue: str) -> list[tuple[bytes, commands.Basic.Properties]]:
    """An empty body, a body of several frames, one with properties and headers: each confirmed."""
    sent = [(b"", commands.Basic.Properties(delivery_mode=2)),
            (bytes(range(256)) * 1200, commands.Basic.Properties(delivery_mode=2, content_type="x/y")),
            (b"h", commands.Basic.Properties(delivery_mode=2, message_id="m-1", priority=3,
                                             headers={"a": "b", "n": 7, "t": {"x": True}}))]
    conn = await aiormq.connect(url)
    try:
        ch = await conn.channel()
        await ch.queue_declare(queue, durable=True)
        for body, props in sent:
            await ch.basic_publish(body, routing_key=queue, properties=props)
    finally:
        await conn.close()
    return sent


async def _consume_odd(url: str, queue: str, n: int) -> list[Message]:
    d = parse("/", "t", {"src-uri": url, "src-queue": queue, "dest-uri": "amqp://", "dest-queue": "x"})
    src = AmqpSource(d, unique("tag"), {})
    got: list[Message] = []
    done = asyncio.Event()

    def on_message(m: Message) -> None:
        got.append(m)
        src.settle(m.tag, Settle.ACK)
        if len(got) == n:
            done.set()

    await src.open(on_message)
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await src.close()
    return got


def test_deliveries_of_every_shape_arrive_whole_with_their_properties(broker: SkredProcess) -> None:
    """The source reads frames in place: an empty body (no body frame), a body split over frames
    larger than a read, properties with nested headers; each arrives as sent, and is acked."""
    queue = unique("acks-shapes")
    sent = asyncio.run(_publish_odd(broker.url, queue))
    got = asyncio.run(_consume_odd(broker.url, queue, len(sent)))
    assert [m.body for m in got] == [body for body, _ in sent]
    for m, (_, props) in zip(got, sent, strict=True):
        p = m.props
        fields = ("message_id", "priority", "content_type", "delivery_mode", "headers")
        assert [getattr(p, f) for f in fields] == [getattr(props, f) for f in fields]
    assert asyncio.run(_ready_count(broker.url, queue)) == 0


def test_an_amqps_source_with_a_client_certificate(tmp_path: Path) -> None:
    """``amqps://`` with aiormq's query options: the source verifies the broker against ``cafile``
    and presents ``certfile``/``keyfile`` to a broker that demands a client certificate; without
    one the connection is refused."""
    pki = make_pki(tmp_path / "pki")
    tls_port = free_port()
    b = SkredProcess(tmp_path / "data", tls_args(pki, "--amqp-tls-port", str(tls_port), "--tls-verify-peer",
                                                 "--tls-fail-if-no-peer-cert"))
    b.start()
    try:
        queue = unique("acks-tls")
        publish(b.url, queue, "t", 5, declare={})
        base = f"amqps://guest:guest@127.0.0.1:{tls_port}/%2F?cafile={quote(str(pki.ca.cert_path))}"
        with_cert = f"{base}&certfile={quote(str(pki.client.cert))}&keyfile={quote(str(pki.client.key))}"
        got = asyncio.run(_consume_odd(with_cert, queue, 5))
        assert sorted(m.body.split(b"|")[0] for m in got) == [f"t#{i}".encode() for i in range(5)]
        # the destination over the same URI options
        verdicts, _ = asyncio.run(_push(with_cert, queue, 3))
        assert verdicts == [Verdict.OK] * 3 and asyncio.run(_ready_count(b.url, queue)) == 3
        with pytest.raises(EndLost):  # (TLS 1.3: refused at the handshake or right after it)
            asyncio.run(_consume_odd(base, queue, 1))
    finally:
        b.close()


SHAPES = [(b"", commands.Basic.Properties(delivery_mode=2)),
          (bytes(range(256)) * 1200, commands.Basic.Properties(delivery_mode=2, content_type="x/y")),
          (b"h", commands.Basic.Properties(delivery_mode=2, message_id="m-1", priority=3,
                                           headers={"a": "b", "n": 7, "t": {"x": True}}))]


async def _push(url: str, queue: str, n: int) -> tuple[list[Verdict], int]:
    """``n`` messages (the shapes in turn, numbered) handed to the destination in one turn: the
    verdicts, and how many writes the destination made."""
    d = parse("/", "t", {"src-uri": "amqp://", "src-queue": "x", "dest-uri": url, "dest-queue": queue})
    dst = AmqpDestination(d)
    await dst.open()
    writes = 0
    real = dst._flush

    def counted() -> None:
        nonlocal writes
        writes += bool(dst.out)
        real()
    dst._flush = counted  # type: ignore[method-assign]
    verdicts: list[Verdict] = []
    done = asyncio.Event()

    def later(v: Verdict) -> None:
        verdicts.append(v)
        if len(verdicts) == n:
            done.set()
    try:
        for i in range(n):
            body, props = SHAPES[i % len(SHAPES)]
            msg = Message("", queue, None, f"{i}|".encode() + body, False, i, raw=properties.encode(props))
            assert dst.send_now(msg, later) is None  # on-confirm: the verdict comes with the confirm
        await asyncio.wait_for(done.wait(), 60)
    finally:
        await dst.close()
    return verdicts, writes


async def _take(url: str, queue: str, n: int) -> list[tuple[bytes, commands.Basic.Properties]]:
    conn = await aiormq.connect(url)
    out = []
    try:
        ch = await conn.channel()
        for _ in range(n):
            got = await ch.basic_get(queue, no_ack=True)
            assert got.body is not None and got.header is not None
            out.append((got.body, got.header.properties))
    finally:
        await conn.close()
    return out


def test_the_destination_writes_a_turn_at_once_and_confirms_by_range(broker: SkredProcess) -> None:
    """300 publishes handed over in one turn (as a source's socket read is): a few writes, every
    one confirmed OK (the broker's confirms come as multiple acks), each message arriving in order
    with its body and properties as they were (the raw property bytes passed through)."""
    queue, n = unique("dest-batch"), 300
    verdicts, writes = asyncio.run(_push(broker.url, queue, n))
    assert verdicts == [Verdict.OK] * n
    assert writes <= 1 + sum(len(b) for b, _ in SHAPES) * n // (3 * 256 * 1024) + 2, f"{writes} writes"
    got = asyncio.run(_take(broker.url, queue, n))
    fields = ("message_id", "priority", "content_type", "delivery_mode", "headers")
    for i, (body, props) in enumerate(got):
        sent_body, sent_props = SHAPES[i % len(SHAPES)]
        assert body == f"{i}|".encode() + sent_body
        assert [getattr(props, f) for f in fields] == [getattr(sent_props, f) for f in fields]
