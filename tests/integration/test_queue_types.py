"""Queue types as RabbitMQ 4 clients declare them, over AMQP (pika) against a real Skred process:
``classic``/``quorum``/``stream``, unknown types and impossible quorum properties refused with 406,
quorum delivery limit (default 20) with ``x-delivery-count``, ``x-dead-letter-strategy:
at-least-once`` keeping what the dead-letter target refuses, and the vhost ``default_queue_type``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from ._support import SkredProcess, connect, unique, wait_until
from .test_mgmt_api import Api, pytestmark, q, start_mgmt_broker

__all__ = ["pytestmark"]


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("qtypes"))
    yield b
    b.close()


def declare_fails(b: SkredProcess, name: str, **kw: object) -> pika.exceptions.ChannelClosedByBroker:
    conn = connect(b)
    try:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            ch.queue_declare(name, **kw)  # type: ignore[arg-type]
        return info.value
    finally:
        conn.close()


def test_unknown_type_and_impossible_quorum_properties_are_406(mb: SkredProcess) -> None:
    err = declare_fails(mb, unique("q"), durable=True, arguments={"x-queue-type": "bogus"})
    assert err.reply_code == 406 and "bogus" in err.reply_text
    for kw, prop in (({"durable": False}, "non-durable"), ({"durable": True, "exclusive": True},
                                                           "exclusive-owner"),
                     ({"durable": True, "auto_delete": True}, "auto-delete")):
        for qtype in ("quorum", "stream"):
            err = declare_fails(mb, unique("q"), arguments={"x-queue-type": qtype}, **kw)
            assert err.reply_code == 406 and prop in err.reply_text, (qtype, kw, err)
    api = Api(mb.mgmt_port)
    status, body, _ = api.call("PUT", f"/api/queues/%2F/{unique('q')}", {"durable": True,
                                                                         "arguments": {"x-queue-type": "x"}})
    assert status == 400 and "x" in body["reason"]


def test_types_reported_and_redeclare_equivalence(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    conn = connect(mb)
    try:
        ch = conn.channel()
        names = {t: unique(t) for t in ("classic", "quorum", "stream")}
        for t, n in names.items():
            ch.queue_declare(n, durable=True, arguments={"x-queue-type": t})
            ch.queue_declare(n, durable=True, arguments={"x-queue-type": t})  # equivalent redeclare
            ch.queue_declare(n, passive=True)
            assert api.get(f"/api/queues/%2F/{q(n)}")["type"] == t
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            ch.queue_declare(names["quorum"], durable=True, arguments={"x-queue-type": "classic"})
        assert info.value.reply_code == 406
    finally:
        if conn.is_open:
            conn.close()


def test_quorum_delivery_limit_default_20_and_delivery_count(mb: SkredProcess) -> None:
    conn = connect(mb)
    try:
        ch = conn.channel()
        name, dlq = unique("qq"), unique("dlq")
        ch.queue_declare(dlq, durable=True)
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum",
                                                        "x-dead-letter-exchange": "",
                                                        "x-dead-letter-routing-key": dlq})
        ch.basic_publish("", name, b"m", pika.BasicProperties(delivery_mode=2))
        counts = []
        for _ in range(21):
            method, props, _body = _get(ch, name)
            counts.append((props.headers or {}).get("x-delivery-count"))
            ch.basic_nack(method.delivery_tag, requeue=True)
        # 20 returns allowed: the 21st is over the limit and dead-lettered
        assert counts == [None] + list(range(1, 21)), counts
        method, props, body = _get(ch, dlq)
        assert body == b"m" and props.headers["x-death"][0]["reason"] == "delivery_limit"
        ch.basic_ack(method.delivery_tag)
        assert ch.queue_declare(name, passive=True).method.message_count == 0
    finally:
        conn.close()


def _get(ch: pika.adapters.blocking_connection.BlockingChannel, name: str) -> tuple:  # type: ignore[type-arg]
    got: list[tuple] = []  # type: ignore[type-arg]

    def poll() -> bool:
        method, props, body = ch.basic_get(name)
        if method is not None:
            got.append((method, props, body))
        return bool(got)
    wait_until(poll, 10, f"a message in {name}")
    return got[0]


def test_at_least_once_dead_lettering_keeps_refused_messages(mb: SkredProcess) -> None:
    conn = connect(mb)
    try:
        ch = conn.channel()
        src, target = unique("src"), unique("target")
        ch.queue_declare(target, durable=True, arguments={"x-queue-type": "quorum", "x-max-length": 1,
                                                          "x-overflow": "reject-publish"})
        ch.queue_declare(src, durable=True, arguments={
            "x-queue-type": "quorum", "x-dead-letter-exchange": "", "x-dead-letter-routing-key": target,
            "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
        ch.basic_publish("", target, b"filler", pika.BasicProperties(delivery_mode=2))
        for body in (b"a", b"b"):
            ch.basic_publish("", src, body, pika.BasicProperties(delivery_mode=2))
        for _ in range(2):
            method, _props, _body = _get(ch, src)
            ch.basic_reject(method.delivery_tag, requeue=False)
        # the target is full: both wait in the source rather than being dropped
        assert ch.queue_declare(target, passive=True).method.message_count == 1
        got = []
        for _ in range(3):
            method, _props, body = _get(ch, target)
            got.append(body)
            ch.basic_ack(method.delivery_tag)  # room for the next retry
        assert got == [b"filler", b"a", b"b"]
    finally:
        conn.close()


def test_vhost_default_queue_type(mb: SkredProcess, tmp_path: Path) -> None:
    api = Api(mb.mgmt_port)
    vh = unique("vh")
    api.ok("PUT", f"/api/vhosts/{q(vh)}", {"default_queue_type": "quorum"})
    assert api.get(f"/api/vhosts/{q(vh)}")["default_queue_type"] == "quorum"
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", mb.port, vh))
    try:
        ch = conn.channel()
        durable, transient, excl = unique("d"), unique("t"), unique("x")
        ch.queue_declare(durable, durable=True)
        ch.queue_declare(transient, durable=False)  # RabbitMQ 4: stays classic
        ch.queue_declare(excl, exclusive=True)
        ch.queue_declare(durable, durable=True)  # redeclare without a type is equivalent
        types = {x["name"]: x["type"] for x in api.get(f"/api/queues/{q(vh)}")}
        assert types == {durable: "quorum", transient: "classic", excl: "classic"}
    finally:
        conn.close()
    status, _body, _ = api.call("PUT", f"/api/vhosts/{q(vh)}", {"default_queue_type": "nope"})
    assert status == 400


def test_quorum_refuses_global_qos_and_max_priority(mb: SkredProcess) -> None:
    """As RabbitMQ 3.10/4: 540 for a consumer under a global prefetch, 406 for x-max-priority."""
    name = unique("gq")
    err = declare_fails(mb, name, durable=True, arguments={"x-queue-type": "quorum", "x-max-priority": 5})
    assert err.reply_code == 406 and "x-max-priority" in err.reply_text
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
        ch.basic_qos(prefetch_count=5, global_qos=True)
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
            ch.basic_consume(name, lambda *a: None)
        assert info.value.reply_code == 540 and "global qos" in info.value.reply_text
    finally:
        if conn.is_open:
            conn.close()


def test_consumer_timeout_from_a_policy(mb: SkredProcess) -> None:
    """RabbitMQ's ``consumer-timeout`` policy key (quorum queues' per-queue timeout)."""
    api = Api(mb.mgmt_port)
    name = unique("ctq")
    api.ok("PUT", f"/api/policies/%2F/{q(name)}", {"pattern": f"^{name}$", "apply-to": "queues",
                                                     "definition": {"consumer-timeout": 1000}})
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
        ch.basic_publish("", name, b"m")
        reasons: list[pika.spec.Channel.Close] = []
        ch._impl.add_on_close_callback(lambda c, reason: reasons.append(reason))
        ch.basic_consume(name, lambda c, m, p, body: None)
        wait_until(lambda: (conn.process_data_events(0.05), bool(reasons))[1], 15, "the timeout")
        assert reasons[0].reply_code == 406 and "timed out" in reasons[0].reply_text
    finally:
        if conn.is_open:
            conn.close()
        api.ok("DELETE", f"/api/policies/%2F/{q(name)}")


def _publish_levels(ch: pika.adapters.blocking_connection.BlockingChannel, name: str,
                    batches: list[tuple[str, int | None, int]]) -> None:
    """Publish ``(label, priority, count)`` batches in order; a later batch is younger by at
    least one clock millisecond (publish times order the two levels' heads)."""
    for label, prio, count in batches:
        start = time.time()
        for i in range(count):
            ch.basic_publish("", name, f"{label}{i}".encode(),
                             pika.BasicProperties(priority=prio, delivery_mode=2))
        ch.queue_declare(name, passive=True)  # a round trip: the batch is in the queue
        wait_until(lambda start=start: time.time() > start + 0.002, 5, "the clock to move on")


def test_quorum_two_priority_levels(mb: SkredProcess) -> None:
    """RabbitMQ 4 quorum queues: priority above 4 is high, anything else normal (no
    x-max-priority); with both waiting, two high for every normal, so a normal backlog is not
    starved; high messages published first are not overtaken by younger normal ones."""
    conn = connect(mb)
    try:
        ch = conn.channel()
        name = unique("qprio")
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
        _publish_levels(ch, name, [("n", None, 3), ("n", 4, 3), ("h", 5, 3), ("h", 9, 3)])
        got = [_get(ch, name)[2].decode() for _ in range(12)]
        assert [b[0] for b in got] == list("hhnhhnhhnnnn"), got
        assert [b for b in got if b[0] == "n"] == ["n0", "n1", "n2", "n0", "n1", "n2"]  # FIFO per level
        # high first, then normal: nothing overtakes, to a consumer as well as to basic.get
        _publish_levels(ch, name, [("h", 7, 4), ("n", 0, 4)])
        ch.basic_qos(prefetch_count=1)
        seen: list[str] = []

        def on_message(c: pika.adapters.blocking_connection.BlockingChannel, m: pika.spec.Basic.Deliver,
                       p: pika.BasicProperties, body: bytes) -> None:
            seen.append(body.decode())
            c.basic_ack(m.delivery_tag)
        ch.basic_consume(name, on_message)
        wait_until(lambda: (conn.process_data_events(0.05), len(seen) == 8)[1], 20, "8 deliveries")
        assert [b[0] for b in seen] == list("hhhhnnnn"), seen
    finally:
        conn.close()


def test_quorum_priorities_survive_a_restart(tmp_path: Path) -> None:
    b = start_mgmt_broker(tmp_path)
    try:
        conn = connect(b)
        ch = conn.channel()
        ch.confirm_delivery()
        name = unique("qprio")
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
        _publish_levels(ch, name, [("n", None, 2), ("h", 8, 2)])
        conn.close()
        b.kill9()
        b.start()
        conn = connect(b)
        ch = conn.channel()
        got = [_get(ch, name)[2].decode()[0] for _ in range(4)]
        assert got == list("hhnn"), got
        conn.close()
    finally:
        b.close()


@pytest.mark.parametrize("sync_interval", [None, 0], ids=["window", "synchronous"])
def test_quorum_delivery_count_survives_kill9(tmp_path: Path, sync_interval: int | None) -> None:
    """The delivery count is durable like an ack (RabbitMQ keeps it in the Raft log): after
    kill -9 the message comes back with its count, and the limit counts on from there."""
    extra = [] if sync_interval is None else ["--ack-sync-interval", str(sync_interval)]
    b = start_mgmt_broker(tmp_path, extra)
    try:
        conn = connect(b)
        ch = conn.channel()
        ch.confirm_delivery()
        name, dlq = unique("qq"), unique("dlq")
        ch.queue_declare(dlq, durable=True)
        ch.queue_declare(name, durable=True, arguments={
            "x-queue-type": "quorum", "x-delivery-limit": 4, "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dlq})
        ch.basic_publish("", name, b"m", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("", name, b"other", pika.BasicProperties(delivery_mode=2))
        for _ in range(3):
            method, _props, _body = _get(ch, name)
            assert _body == b"m"
            ch.basic_nack(method.delivery_tag, requeue=True)
        ch.queue_declare(name, passive=True)  # a round trip after the last nack
        if sync_interval is None:
            time.sleep(2.5)  # the property under test: the ack window (1 s) has passed
        conn.close()
        b.kill9()
        b.start()
        conn = connect(b)
        ch = conn.channel()
        method, props, body = _get(ch, name)
        assert body == b"m" and method.redelivered
        assert (props.headers or {}).get("x-delivery-count") == 3, props.headers
        ch.basic_nack(method.delivery_tag, requeue=True)  # the 4th return: at the limit
        method, props, body = _get(ch, name)
        assert body == b"m" and props.headers["x-delivery-count"] == 4
        ch.basic_nack(method.delivery_tag, requeue=True)  # the 5th: over it, dead-lettered
        method, props, body = _get(ch, dlq)
        assert body == b"m" and props.headers["x-death"][0]["reason"] == "delivery_limit"
        method, props, body = _get(ch, name)
        assert body == b"other" and "x-delivery-count" not in (props.headers or {})
        conn.close()  # returns "other", unacked: a return counts (RabbitMQ 4.0-4.2)
        b.restart()
        conn = connect(b)
        ch = conn.channel()
        method, props, body = _get(ch, name)
        assert body == b"other" and props.headers["x-delivery-count"] == 1
        ch.basic_ack(method.delivery_tag)
        conn.close()
    finally:
        b.close()
