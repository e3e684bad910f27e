"""Exchange types, bindings and exchange-level errors, through pika."""

from __future__ import annotations

from typing import Any

import pika
import pytest

from ._support import Cleanup, channel_error, drain, exists_exchange, get_body, unique

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes


def _bound_queue(
    ch: pika.adapters.blocking_connection.BlockingChannel,
    exchange: str,
    key: str = "",
    arguments: dict[str, Any] | None = None,
) -> str:
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, exchange, routing_key=key, arguments=arguments)
    return str(q)


def test_direct_routes_by_exact_key(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    ch = pika_conn.channel()
    x = cleanup.exchange()
    ch.exchange_declare(x, "direct", auto_delete=False)
    qa, qb = _bound_queue(ch, x, "a"), _bound_queue(ch, x, "b")
    qa2 = _bound_queue(ch, x, "a")
    ch.basic_publish(x, "a", b"to-a")
    ch.basic_publish(x, "b", b"to-b")
    ch.basic_publish(x, "A", b"nobody")  # keys are case-sensitive
    assert drain(ch, qa) == [b"to-a"]
    assert drain(ch, qa2) == [b"to-a"]
    assert drain(ch, qb) == [b"to-b"]


def test_fanout_ignores_key(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    ch = pika_conn.channel()
    x = cleanup.exchange()
    ch.exchange_declare(x, "fanout")
    qs = [_bound_queue(ch, x, k) for k in ("", "x", "y")]
    ch.basic_publish(x, "whatever", b"m1")
    ch.basic_publish(x, "", b"m2")
    for q in qs:
        assert drain(ch, q) == [b"m1", b"m2"]


# (binding pattern, routing keys that match, routing keys that do not)
TOPIC_CASES = [
    ("a.*.c", ["a.b.c", "a.x.c"], ["a.c", "a.b.b.c", "a.b.c.d", "b.b.c"]),
    ("a.#", ["a", "a.b", "a.b.c.d"], ["b", "b.a", "ab"]),
    ("#.c", ["c", "a.c", "a.b.c"], ["c.a", "ac"]),
    ("a.#.c", ["a.c", "a.b.c", "a.b.b.c"], ["a.b", "b.c", "a.c.d"]),
    ("*.b.*", ["a.b.c", "x.b.y"], ["b.c", "a.b", "a.b.c.d"]),
    ("#", ["a", "a.b.c", "x.y"], []),
    ("*", ["a", "abc"], ["a.b"]),
    ("a.b", ["a.b"], ["a.b.c", "a", "a.bb"]),
    ("*.*", ["a.b"], ["a", "a.b.c"]),
    ("#.b.#", ["b", "a.b", "b.c", "a.b.c"], ["a.c", "ab.c"]),
]


@pytest.mark.parametrize("pattern,hits,misses", TOPIC_CASES, ids=[c[0] for c in TOPIC_CASES])
def test_topic_wildcards(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup, pattern: str, hits: list[str], misses: list[str]
) -> None:
    ch = pika_conn.channel()
    x = cleanup.exchange()
    ch.exchange_declare(x, "topic")
    q = _bound_queue(ch, x, pattern)
    for key in hits + misses:
        ch.basic_publish(x, key, key.encode())
    assert drain(ch, q) == [k.encode() for k in hits]


def test_headers_exchange_all_and_any(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    ch = pika_conn.channel()
    x = cleanup.exchange()
    ch.exchange_declare(x, "headers")
    q_all = _bound_queue(ch, x, arguments={"x-match": "all", "fmt": "pdf", "kind": "report"})
    q_any = _bound_queue(ch, x, arguments={"x-match": "any", "fmt": "pdf", "kind": "report"})
    q_default = _bound_queue(ch, x, arguments={"fmt": "pdf", "kind": "report"})  # default is all
    q_int = _bound_queue(ch, x, arguments={"x-match": "all", "n": 7})

    def pub(body: bytes, headers: dict[str, Any] | None) -> None:
        ch.basic_publish(x, "ignored", body, pika.BasicProperties(headers=headers))

    pub(b"both", {"fmt": "pdf", "kind": "report", "extra": 1})
    pub(b"fmt-only", {"fmt": "pdf"})
    pub(b"wrong-value", {"fmt": "doc", "kind": "memo"})
    pub(b"none", None)
    pub(b"int7", {"n": 7})
    pub(b"int8", {"n": 8})
    assert drain(ch, q_all) == [b"both"]
    assert drain(ch, q_default) == [b"both"]
    assert drain(ch, q_any) == [b"both", b"fmt-only"]
    assert drain(ch, q_int) == [b"int7"]


def test_default_exchange_routes_to_queue_name(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare(unique("q"), exclusive=True).method.queue
    ch.basic_publish("", q, b"hello")
    ch.basic_publish("", q + ".nope", b"lost")
    assert drain(ch, q) == [b"hello"]


def test_default_exchange_cannot_be_bound_or_deleted(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    with channel_error(403):
        ch.queue_bind(q, "", routing_key="x")
    ch = pika_conn.channel()
    with channel_error(403):
        ch.exchange_delete("")
    assert pika_conn.is_open


@pytest.mark.parametrize(
    "name,kind,key,args",
    [
        ("amq.direct", "direct", "k.1", None),
        ("amq.fanout", "fanout", "", None),
        ("amq.topic", "topic", "k.*", None),
        ("amq.headers", "headers", "", {"x-match": "any", "h": "v"}),
        ("amq.match", "headers", "", {"x-match": "any", "h": "v"}),
    ],
)
def test_builtin_amq_exchanges(
    pika_conn: pika.BlockingConnection, name: str, kind: str, key: str, args: dict[str, Any] | None
) -> None:
    ch = pika_conn.channel()
    ch.exchange_declare(name, kind, passive=True)
    q = _bound_queue(ch, name, key, args)
    ch.basic_publish(name, "k.1", b"m", pika.BasicProperties(headers={"h": "v"}))
    assert drain(ch, q) == [b"m"]


def test_exchange_to_exchange_binding_and_unbind(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup
) -> None:
    ch = pika_conn.channel()
    src, mid, dst = cleanup.exchange(), cleanup.exchange(), cleanup.exchange()
    ch.exchange_declare(src, "topic")
    ch.exchange_declare(mid, "fanout")
    ch.exchange_declare(dst, "direct")
    ch.exchange_bind(destination=mid, source=src, routing_key="orders.*")
    ch.exchange_bind(destination=dst, source=mid)
    q_mid = _bound_queue(ch, mid)
    q_dst = _bound_queue(ch, dst, "orders.new")
    ch.basic_publish(src, "orders.new", b"1")
    ch.basic_publish(src, "orders.old", b"2")
    ch.basic_publish(src, "users.new", b"3")
    assert drain(ch, q_mid) == [b"1", b"2"]
    assert drain(ch, q_dst) == [b"1"]
    ch.exchange_unbind(destination=mid, source=src, routing_key="orders.*")
    ch.basic_publish(src, "orders.new", b"4")
    assert get_body(ch, q_mid) is None
    assert get_body(ch, q_dst) is None


def test_exchange_binding_cycle_delivers_once(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    ch = pika_conn.channel()
    a, b = cleanup.exchange(), cleanup.exchange()
    ch.exchange_declare(a, "fanout")
    ch.exchange_declare(b, "fanout")
    ch.exchange_bind(destination=b, source=a)
    ch.exchange_bind(destination=a, source=b)
    q = _bound_queue(ch, b)
    ch.basic_publish(a, "", b"once")
    assert drain(ch, q) == [b"once"]


def test_queue_unbind_stops_routing(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    ch = pika_conn.channel()
    x = cleanup.exchange()
    ch.exchange_declare(x, "direct")
    q = _bound_queue(ch, x, "k")
    ch.basic_publish(x, "k", b"before")
    ch.queue_unbind(q, x, routing_key="k")
    ch.basic_publish(x, "k", b"after")
    assert drain(ch, q) == [b"before"]


def test_exchange_delete_and_if_unused(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    ch = pika_conn.channel()
    x = cleanup.exchange()
    ch.exchange_declare(x, "direct")
    q = _bound_queue(ch, x, "k")
    with channel_error(406):
        ch.exchange_delete(x, if_unused=True)
    ch = pika_conn.channel()
    ch.queue_unbind(q, x, routing_key="k")
    ch.exchange_delete(x, if_unused=True)
    assert not exists_exchange(pika_conn, x)


def test_exchange_passive_missing_is_404_channel_only(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    other = pika_conn.channel()
    with channel_error(404):
        ch.exchange_declare(unique("missing"), "direct", passive=True)
    assert pika_conn.is_open and other.is_open
    other.queue_declare("", exclusive=True)


def test_exchange_redeclare_different_type_is_406(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup
) -> None:
    ch = pika_conn.channel()
    x = cleanup.exchange()
    ch.exchange_declare(x, "direct")
    other = pika_conn.channel()
    with channel_error(406):
        ch.exchange_declare(x, "fanout")
    ch = pika_conn.channel()
    with channel_error(406):
        ch.exchange_declare(x, "direct", durable=True)
    assert pika_conn.is_open and other.is_open
    other.exchange_declare(x, "direct")  # the equivalent declaration still works


def test_declare_amq_prefixed_exchange_is_403(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    with channel_error(403):
        ch.exchange_declare("amq." + unique("x"), "direct")
    assert pika_conn.is_open
    assert not exists_exchange(pika_conn, "amq.nonexistent-" + unique("x"))


def test_unknown_exchange_type_is_an_error(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    # Spec: 503 COMMAND_INVALID; RabbitMQ 3.10 answers with a 503 connection close.
    # Either a channel or a connection close with 503 is accepted here.
    try:
        ch.exchange_declare(unique("x"), "no-such-type")
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code in (503, 406)
    except pika.exceptions.ConnectionClosedByBroker as exc:
        assert exc.reply_code == 503
    else:
        raise AssertionError("declaring an unknown exchange type succeeded")


def test_publish_to_missing_exchange_is_404_channel_only(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    other = pika_conn.channel()
    q = other.queue_declare("", exclusive=True).method.queue
    ch.basic_publish(unique("missing"), "k", b"x")
    with channel_error(404):
        ch.queue_declare("", exclusive=True)  # a synchronous call surfaces the async close
    assert pika_conn.is_open and other.is_open
    other.basic_publish("", q, b"still-works")
    assert drain(other, q) == [b"still-works"]
