"""The same broker through aio-pika (asyncio): round trip, confirms, tx, RPC, properties."""

from __future__ import annotations

import asyncio
import datetime
from decimal import Decimal
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from pamqp.commands import Basic

from ._support import Broker, run_async, unique

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes

HEADERS: dict[str, Any] = {
    "s": "text ✓",
    "i": 123456789,
    "neg": -5,
    "big": 2**62,
    "t": True,
    "f": False,
    "dec": Decimal("3.14"),
    "ts": datetime.datetime(2020, 5, 6, 7, 8, 9, tzinfo=datetime.UTC),
    "arr": [1, "a", [2, {"k": "v"}]],
    "tbl": {"x": {"y": [Decimal("0.5")]}},
    "none": None,
    "float": 2.5,
}


async def _connect(b: Broker) -> aio_pika.abc.AbstractConnection:
    return await aio_pika.connect(b.url, timeout=5)


async def _get(queue: aio_pika.abc.AbstractQueue, timeout: float = 5.0) -> AbstractIncomingMessage:
    """Wait for one message via basic.consume, with a deadline."""
    async with queue.iterator() as it:
        return await asyncio.wait_for(it.__anext__(), timeout)


def test_publish_consume_round_trip(shared_broker: Broker) -> None:
    async def scenario() -> None:
        conn = await _connect(shared_broker)
        async with conn:
            ch = await conn.channel()
            q = await ch.declare_queue(exclusive=True)
            x = await ch.declare_exchange(unique("x"), aio_pika.ExchangeType.TOPIC, auto_delete=True)
            await q.bind(x, "a.#")
            for i in range(50):
                await x.publish(aio_pika.Message(b"%d" % i), routing_key=f"a.{i}")
            await x.publish(aio_pika.Message(b"miss"), routing_key="b.1")
            got: list[bytes] = []
            async with q.iterator() as it:
                async for msg in it:
                    async with msg.process():
                        got.append(msg.body)
                    if len(got) == 50:
                        break
            assert got == [b"%d" % i for i in range(50)]
            assert await q.get(fail=False, no_ack=True) is None

    run_async(scenario())


def test_confirms_many(shared_broker: Broker) -> None:
    async def scenario() -> None:
        conn = await _connect(shared_broker)
        async with conn:
            ch = await conn.channel(publisher_confirms=True)
            q = await ch.declare_queue(exclusive=True)
            n = 2000
            confirms = await asyncio.gather(
                *(
                    ch.default_exchange.publish(
                        aio_pika.Message(b"%d" % i, delivery_mode=2), routing_key=q.name
                    )
                    for i in range(n)
                )
            )
            assert len(confirms) == n
            assert all(isinstance(c, Basic.Ack) for c in confirms)
            declared = await ch.declare_queue(q.name, passive=True)
            assert declared.declaration_result.message_count == n

    run_async(scenario())


def test_confirm_mandatory_unroutable_is_returned(shared_broker: Broker) -> None:
    async def scenario() -> None:
        conn = await _connect(shared_broker)
        async with conn:
            ch = await conn.channel(publisher_confirms=True, on_return_raises=True)
            with pytest.raises(aio_pika.exceptions.DeliveryError) as ei:
                await ch.default_exchange.publish(
                    aio_pika.Message(b"x"), routing_key=unique("nowhere"), mandatory=True
                )
            assert ei.value.message is not None and ei.value.message.body == b"x"

    run_async(scenario())


def test_transactions(shared_broker: Broker) -> None:
    async def scenario() -> None:
        conn = await _connect(shared_broker)
        async with conn:
            ch = await conn.channel(publisher_confirms=False)
            q = await ch.declare_queue(exclusive=True)
            tx = ch.transaction()
            await tx.select()
            await ch.default_exchange.publish(aio_pika.Message(b"rolled-back"), routing_key=q.name)
            await tx.rollback()
            await ch.default_exchange.publish(aio_pika.Message(b"committed"), routing_key=q.name)
            await tx.commit()
            m = await q.get(no_ack=True, fail=False)
            assert m is not None and m.body == b"committed"
            assert await q.get(no_ack=True, fail=False) is None

            # acks inside a transaction take effect on commit only
            await ch.default_exchange.publish(aio_pika.Message(b"acked"), routing_key=q.name)
            await tx.commit()
            m = await q.get(no_ack=False)
            await m.ack()
            await tx.rollback()  # the ack is discarded; the message stays unacked
            await ch.close()  # ... and is requeued on close
            ch2 = await conn.channel()
            q2 = await ch2.declare_queue(q.name, passive=True)
            m = await q2.get(no_ack=True)
            assert m.body == b"acked" and m.redelivered

    run_async(scenario())


def test_direct_reply_to_rpc(shared_broker: Broker) -> None:
    async def scenario() -> None:
        server = await _connect(shared_broker)
        client = await _connect(shared_broker)
        async with server, client:
            sch = await server.channel()
            rpc_q = await sch.declare_queue(exclusive=True)

            async def serve(msg: AbstractIncomingMessage) -> None:
                async with msg.process():
                    assert msg.reply_to and msg.reply_to.startswith("amq.rabbitmq.reply-to.")
                    await sch.default_exchange.publish(
                        aio_pika.Message(b"pong:" + msg.body, correlation_id=msg.correlation_id),
                        routing_key=msg.reply_to,
                    )

            await rpc_q.consume(serve)
            cch = await client.channel()
            reply_q = await cch.get_queue("amq.rabbitmq.reply-to", ensure=False)
            replies: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
            await reply_q.consume(replies.put, no_ack=True)
            for i in range(3):
                await cch.default_exchange.publish(
                    aio_pika.Message(b"ping%d" % i, reply_to="amq.rabbitmq.reply-to", correlation_id=f"c{i}"),
                    routing_key=rpc_q.name,
                )
            got = [await asyncio.wait_for(replies.get(), 5) for _ in range(3)]
            assert sorted((m.correlation_id, m.body) for m in got) == [
                (f"c{i}", b"pong:ping%d" % i) for i in range(3)
            ]

    run_async(scenario())


def test_properties_and_headers_round_trip(shared_broker: Broker) -> None:
    async def scenario() -> None:
        conn = await _connect(shared_broker)
        async with conn:
            ch = await conn.channel()
            q = await ch.declare_queue(exclusive=True)
            ts = datetime.datetime(2023, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
            sent = aio_pika.Message(
                body=bytes(range(256)),
                headers=HEADERS,
                content_type="application/octet-stream",
                content_encoding="identity",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                priority=9,
                correlation_id="corr",
                reply_to="somewhere",
                expiration=3600,
                message_id="mid",
                timestamp=ts,
                type="kind",
                user_id="guest",
                app_id="aio-tests",
            )
            await ch.default_exchange.publish(sent, routing_key=q.name)
            got = await _get(q)
            await got.ack()
            assert got.body == bytes(range(256))
            assert got.headers == HEADERS
            for name in (
                "content_type",
                "content_encoding",
                "delivery_mode",
                "priority",
                "correlation_id",
                "reply_to",
                "message_id",
                "type",
                "user_id",
                "app_id",
            ):
                assert getattr(got, name) == getattr(sent, name), name
            assert got.timestamp == ts
            assert got.expiration is not None and float(str(got.expiration)) == 3600

    run_async(scenario())


def test_requeue_redelivered_and_qos(shared_broker: Broker) -> None:
    async def scenario() -> None:
        conn = await _connect(shared_broker)
        async with conn:
            ch = await conn.channel()
            await ch.set_qos(prefetch_count=2)
            q = await ch.declare_queue(exclusive=True)
            for i in range(4):
                await ch.default_exchange.publish(aio_pika.Message(b"%d" % i), routing_key=q.name)
            inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
            await q.consume(inbox.put)
            first = [await asyncio.wait_for(inbox.get(), 5) for _ in range(2)]
            assert [m.body for m in first] == [b"0", b"1"]
            await first[0].nack(requeue=True)
            again = await asyncio.wait_for(inbox.get(), 5)
            assert again.body == b"0" and again.redelivered
            await again.ack()
            await first[1].ack()
            rest = [await asyncio.wait_for(inbox.get(), 5) for _ in range(2)]
            assert sorted(m.body for m in rest) == [b"2", b"3"]
            for m in rest:
                await m.ack()

    run_async(scenario())
