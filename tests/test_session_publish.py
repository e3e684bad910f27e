"""Session-level publish decisions, driven with real frames into a real vhost and store.

Mostly publish runs: publishes that repeat the previous one's basic.publish method frame
are parsed as one run (``AMQPConnection.handle_publish_run``) and routed once
(``Session.handle_publish_run``); every outcome must equal publishing the messages one by
one. Also the one-by-one path's per-message decisions (persistence)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands, header
from pamqp import frame as pframe

from broker import properties
from broker.amqp import codec
from broker.amqp.connection import PublishArgs
from broker.amqp.session import Session
from broker.config import load_config
from broker.model import features
from broker.model.queue import Queue
from broker.node import Node


def _publish(exchange: str, rk: str, body: bytes, props: commands.Basic.Properties | None = None,
             ch: int = 1) -> bytes:
    props = props or commands.Basic.Properties(content_type="text/plain")
    return (pframe.marshal(commands.Basic.Publish(exchange=exchange, routing_key=rk), ch)
            + pframe.marshal(header.ContentHeader(0, len(body), props), ch)
            + pframe.marshal(pbody.ContentBody(body), ch))


def _burst(exchange: str, rk: str, n: int, props: commands.Basic.Properties | None = None) -> bytes:
    return b"".join(_publish(exchange, rk, b"m-%05d" % i, props) for i in range(n))


def _bodies(n: int) -> list[bytes]:
    return [b"m-%05d" % i for i in range(n)]


def _methods(out: bytes | bytearray) -> list[Any]:
    found = []
    pos = 0
    while pos < len(out):
        size = int.from_bytes(out[pos + 3 : pos + 7], "big")
        if out[pos] == 1:
            found.append(pframe.unmarshal(bytes(out[pos : pos + 8 + size]))[2])
        pos += 8 + size
    return found


def _drain(q: Queue) -> list[bytes]:
    got = []
    while (m := q.get()) is not None:
        got.append(m[4])
        q.ack(m[0])
    return got


def _session(tmp_path: Path, test: Callable[[Session, Any], None]) -> None:
    """Run ``test(session, broker)`` on an open connection with channel 1 open."""
    async def run() -> None:
        cfg = load_config(["--data-dir", str(tmp_path), "--no-mgmt"], environ={})
        broker = Node(cfg).load(asyncio.get_running_loop())
        s = Session(broker, ("127.0.0.1", 1), lambda: None)
        s.receive_data(b"AMQP\x00\x00\x09\x01")
        s.receive_data(pframe.marshal(commands.Connection.StartOk(
            client_properties={"capabilities": {}}, mechanism="PLAIN", response="\x00guest\x00guest"), 0))
        s.receive_data(pframe.marshal(commands.Connection.TuneOk(2047, 131072, 0), 0))
        s.receive_data(pframe.marshal(commands.Connection.Open("/"), 0))
        s.receive_data(pframe.marshal(commands.Channel.Open(), 1))
        try:
            test(s, broker)
        finally:
            for vh in broker.vhosts.values():
                vh.close()

    asyncio.run(run())


@pytest.fixture
def one_by_one_count(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many publishes took ``Session.handle_publish`` (the one-by-one path)."""
    calls = [0]
    orig = Session.handle_publish

    def counting(self: Session, channel: int, args: PublishArgs, props: bytes,
                 body: bytes | memoryview) -> None:
        calls[0] += 1
        orig(self, channel, args, props, body)

    monkeypatch.setattr(Session, "handle_publish", counting)
    return calls


def test_persistence_is_decided_per_message_even_when_properties_repeat(tmp_path: Path) -> None:
    """A persistent message on a confirm channel to a durable queue needs a sync before its
    confirm; a transient one does not. The answer is cached per properties object, so
    repeats of either kind, and switches between them, must each get their own."""
    seen: list[bool] = []

    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="dq", durable=True), 1))
        s.receive_data(pframe.marshal(commands.Confirm.Select(), 1))
        chs = s.chs[1]
        for mode in (2, 2, 1, 1, 2, 1, 2, 2):
            chs.needs_sync = False
            s.receive_data(_publish("", "dq", b"m", commands.Basic.Properties(delivery_mode=mode,
                                                                                content_type="text/plain")))
            seen.append(chs.needs_sync)

    _session(tmp_path, test)
    assert seen == [True, True, False, False, True, False, True, True]


def test_a_run_to_a_plain_queue_is_stored_in_order_and_counted(tmp_path: Path,
                                                               one_by_one_count: list[int]) -> None:
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="q"), 1))
        s.receive_data(pframe.marshal(commands.Confirm.Select(), 1))
        s.out.clear()
        s.receive_data(_burst("", "q", 500))
        q = broker.vhosts["/"].queues["q"]
        assert one_by_one_count[0] == 1  # only the first publish was parsed in full
        assert (q.message_count, q.n_published, s.stats.published) == (500, 500, 500)
        assert s.chs[1].publish_seq == 500
        s.after_batch()
        acks = [m for m in _methods(s.out) if isinstance(m, commands.Basic.Ack)]
        assert [(int(a.delivery_tag), a.multiple) for a in acks] == [(500, True)]
        assert _drain(q) == _bodies(500)

    _session(tmp_path, test)


def test_a_run_through_fanout_reaches_every_queue(tmp_path: Path, one_by_one_count: list[int]) -> None:
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Exchange.Declare(exchange="fan", exchange_type="fanout"), 1))
        for name in ("f1", "f2", "f3"):
            s.receive_data(pframe.marshal(commands.Queue.Declare(queue=name), 1))
            s.receive_data(pframe.marshal(commands.Queue.Bind(queue=name, exchange="fan"), 1))
        s.receive_data(_burst("fan", "any", 300))
        assert one_by_one_count[0] == 1
        for name in ("f1", "f2", "f3"):
            assert _drain(broker.vhosts["/"].queues[name]) == _bodies(300)

    _session(tmp_path, test)


def test_a_run_to_a_missing_exchange_closes_the_channel_once(tmp_path: Path) -> None:
    """The first publish fails with 404; the rest of the run is dropped with the channel,
    exactly as frames behind a channel.close are; the connection goes on."""
    def test(s: Session, broker: Any) -> None:
        s.out.clear()
        s.receive_data(_burst("nope", "q", 200))
        closes = [m for m in _methods(s.out) if isinstance(m, commands.Channel.Close)]
        assert [int(c.reply_code) for c in closes] == [404]
        assert s.stats.published == 1
        s.receive_data(pframe.marshal(commands.Channel.CloseOk(), 1)
                       + pframe.marshal(commands.Channel.Open(), 1))
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="q2"), 1) + _burst("", "q2", 50))
        assert _drain(broker.vhosts["/"].queues["q2"]) == _bodies(50)

    _session(tmp_path, test)


def test_a_run_in_a_transaction_waits_for_commit(tmp_path: Path) -> None:
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="tq"), 1))
        q = broker.vhosts["/"].queues["tq"]
        s.receive_data(_burst("", "tq", 3))  # outside the transaction: stored at once
        assert _drain(q) == _bodies(3)
        s.receive_data(pframe.marshal(commands.Tx.Select(), 1))
        s.receive_data(_burst("", "tq", 100))
        assert q.message_count == 0
        s.receive_data(pframe.marshal(commands.Tx.Rollback(), 1))
        s.receive_data(_burst("", "tq", 100))
        s.receive_data(pframe.marshal(commands.Tx.Commit(), 1))
        assert _drain(q) == _bodies(100)

    _session(tmp_path, test)


def test_a_run_to_a_queue_with_features_is_published_one_by_one(tmp_path: Path,
                                                                 one_by_one_count: list[int]) -> None:
    """x-max-length with reject-publish: the first 30 are kept, the other 70 are nacked."""
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(
            queue="lq", arguments={"x-max-length": 30, "x-overflow": "reject-publish"}), 1))
        s.receive_data(pframe.marshal(commands.Confirm.Select(), 1))
        s.out.clear()
        s.receive_data(_burst("", "lq", 100))
        s.after_batch()
        assert one_by_one_count[0] == 100
        confirms = [m for m in _methods(s.out) if isinstance(m, commands.Basic.Ack | commands.Basic.Nack)]
        acked = nacked = 0
        last = 0
        for m in confirms:
            tags = range(last + 1, int(m.delivery_tag) + 1) if m.multiple else [int(m.delivery_tag)]
            last = max(last, int(m.delivery_tag))
            if isinstance(m, commands.Basic.Ack):
                acked += len(tags)
            else:
                nacked += len(tags)
        assert (acked, nacked) == (30, 70)
        assert _drain(broker.vhosts["/"].queues["lq"]) == _bodies(30)

    _session(tmp_path, test)


def test_a_run_goes_straight_to_an_autoack_consumer(tmp_path: Path) -> None:
    """Nothing ready and one autoack consumer: the run is delivered, never stored, with
    consecutive delivery tags and the bodies in order."""
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="cq"), 1))
        s.receive_data(pframe.marshal(commands.Basic.Consume(queue="cq", consumer_tag="c1", no_ack=True), 1))
        s.out.clear()
        q = broker.vhosts["/"].queues["cq"]
        s.receive_data(_burst("", "cq", 400))
        assert q.message_count == 0 and q.store.unacked_count == 0
        assert (q.n_published, q.n_delivered, s.stats.delivered) == (400, 400, 400)
        delivers = [m for m in _methods(s.out) if isinstance(m, commands.Basic.Deliver)]
        assert [int(d.delivery_tag) for d in delivers] == list(range(1, 401))
        s.out.clear()
        s.receive_data(_burst("", "cq", 100))  # a second run goes on from tag 401
        delivers = [m for m in _methods(s.out) if isinstance(m, commands.Basic.Deliver)]
        assert [int(d.delivery_tag) for d in delivers] == list(range(401, 501))
        s.out.clear()
        s.receive_data(_burst("", "cq", 400))
        assert all(d.routing_key == "cq" and d.consumer_tag == "c1" for d in delivers)
        # bodies, straight from the frames, compared with the encoder's own output
        want = b"".join(codec.encode_delivery(1, codec.METHOD_ID.pack(0x003C003C) + codec.shortstr(b"c1"),
                                              501 + i, False, b"", b"cq", _props_bytes(), body, 131072)
                        for i, body in enumerate(_bodies(400)))
        assert bytes(s.out) == want

    _session(tmp_path, test)


def test_a_run_to_a_manual_ack_consumer_fills_its_window_then_waits_in_the_store(tmp_path: Path) -> None:
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="mq"), 1))
        s.receive_data(pframe.marshal(commands.Basic.Qos(prefetch_count=50), 1))
        s.receive_data(pframe.marshal(commands.Basic.Consume(queue="mq", consumer_tag="c1"), 1))
        q = broker.vhosts["/"].queues["mq"]
        s.receive_data(_burst("", "mq", 300))
        assert (q.message_count, q.store.unacked_count, len(s.chs[1].unacked)) == (250, 50, 50)
        s.receive_data(pframe.marshal(commands.Basic.Cancel(consumer_tag="c1"), 1))
        s.receive_data(pframe.marshal(commands.Basic.Recover(requeue=True), 1))
        assert q.message_count == 300
        assert _drain(q) == _bodies(300)

    _session(tmp_path, test)


def _props_bytes() -> bytes:
    raw = pframe.marshal(header.ContentHeader(0, 0, commands.Basic.Properties(content_type="text/plain")), 1)
    return raw[7 + 12 : -1]


def _ids_burst(exchange: str, rk: str, n: int, delivery_mode: int | None = None,
               expire_at: int | None = None) -> bytes:
    """Publishes whose properties differ every time (a message-id of varying length),
    like those of most client libraries; ``expire_at``: that one also has an expiration."""
    out = []
    for i in range(n):
        props = commands.Basic.Properties(message_id=f"id-{i}", delivery_mode=delivery_mode,
                                          expiration="60000" if i == expire_at else None)
        out.append(_publish(exchange, rk, b"m-%05d" % i, props))
    return b"".join(out)


def test_a_run_with_per_message_properties_is_one_run_too(tmp_path: Path,
                                                         one_by_one_count: list[int]) -> None:
    """Properties that change every message (message-id) still make one run: stored with
    each message's own properties, and delivered straight to an autoack consumer byte for
    byte as the one-by-one encoder would."""
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="iq"), 1))
        s.receive_data(_ids_burst("", "iq", 300))
        assert one_by_one_count[0] == 1
        q = broker.vhosts["/"].queues["iq"]
        got = []
        while (m := q.get()) is not None:
            got.append((properties.decode(m[3]).message_id, m[4]))
        assert got == [(f"id-{i}", b"m-%05d" % i) for i in range(300)]

        s.receive_data(pframe.marshal(commands.Basic.Consume(queue="iq", consumer_tag="c1", no_ack=True), 1))
        s.out.clear()
        s.receive_data(_ids_burst("", "iq", 300))
        assert one_by_one_count[0] == 1  # the method frame still repeats: no new full parse
        prefix = codec.METHOD_ID.pack(0x003C003C) + codec.shortstr(b"c1")
        want = b"".join(
            codec.encode_delivery(1, prefix, i + 1, False, b"", b"iq", _raw_props(commands.Basic.Properties(
                message_id=f"id-{i}")), b"m-%05d" % i, 131072) for i in range(300))
        assert bytes(s.out) == want
        assert q.message_count == 0 and q.n_delivered == 600  # 300 basic.get, 300 delivered

    _session(tmp_path, test)


def test_a_mixed_run_decides_persistence_and_odd_flags_over_all_messages(tmp_path: Path) -> None:
    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="dq", durable=True), 1))
        s.receive_data(pframe.marshal(commands.Confirm.Select(), 1))
        chs = s.chs[1]
        # transient ones, then one persistent message in the middle of the run
        burst = b"".join(_publish("", "dq", b"m-%05d" % i, commands.Basic.Properties(
            message_id=f"id-{i}", delivery_mode=2 if i == 25 else 1)) for i in range(40))
        chs.needs_sync = False
        s.receive_data(_ids_burst("", "dq", 1, delivery_mode=1))  # parsed in full: the runs' start
        chs.needs_sync = False
        s.receive_data(burst)
        assert chs.needs_sync
        chs.needs_sync = False
        s.receive_data(_ids_burst("", "dq", 40, delivery_mode=1))
        assert not chs.needs_sync
        # one message with an expiration sends the whole run one by one: it is honoured
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="xq"), 1))
        s.receive_data(_ids_burst("", "xq", 20, expire_at=7))
        q = broker.vhosts["/"].queues["xq"]
        got = []
        while (m := q.get()) is not None:
            got.append(properties.decode(m[3]).expiration)
        assert got == [None] * 7 + ["60000"] + [None] * 12

    _session(tmp_path, test)


def _raw_props(props: commands.Basic.Properties) -> bytes:
    raw = pframe.marshal(header.ContentHeader(0, 0, props), 1)
    return raw[7 + 12 : -1]


def _headers_burst(exchange: str, rk: str, n: int, headers: Callable[[int], dict[str, Any]]) -> bytes:
    return b"".join(_publish(exchange, rk, b"m-%05d" % i, commands.Basic.Properties(
        message_id=f"id-{i}", headers=headers(i))) for i in range(n))


def test_headers_without_cc_make_one_run(tmp_path: Path, one_by_one_count: list[int]) -> None:
    """Most client libraries send headers with every message (Celery: task, id, retries):
    they do not route, so they do not split a run; a CC header does, and is honoured."""
    def test(s: Session, broker: Any) -> None:
        vh = broker.vhosts["/"]
        for name in ("hq", "other"):
            s.receive_data(pframe.marshal(commands.Queue.Declare(queue=name), 1))
        s.receive_data(_headers_burst("", "hq", 200, lambda i: {"task": f"t{i % 7}", "id": str(i)}))
        assert one_by_one_count[0] == 1
        got = []
        while (m := vh.queues["hq"].get()) is not None:
            got.append(dict(properties.decode(m[3]).headers))
        assert got == [{"task": f"t{i % 7}", "id": str(i)} for i in range(200)]
        # a value that merely contains "CC" costs a one-by-one publish, nothing else
        s.receive_data(_headers_burst("", "hq", 20, lambda i: {"x": "\x02CC", "n": i}))
        assert vh.queues["hq"].message_count == 20 and vh.queues["other"].message_count == 0
        s.receive_data(_headers_burst("", "hq", 20, lambda i: {"CC": ["other"]} if i == 13 else {"n": i}))
        assert vh.queues["hq"].message_count == 40 and vh.queues["other"].message_count == 1

    _session(tmp_path, test)


@given(st.lists(st.sampled_from([b"C", b"CC", b"\x02", b"x", b"BCC", b"C\x00"]), max_size=40))
@example([b"C\x00"] * 9 + [b"CC"])  # past the lone "C"s looked at one by one
def test_holds_cc_says_what_a_substring_search_says(parts: list[bytes]) -> None:
    data = b"".join(parts)
    assert features.holds_cc(data) == (b"CC" in data)


def test_a_cc_header_after_many_single_cs_is_found_in_a_run(tmp_path: Path) -> None:
    """The run's CC check looks at each "C" on its own only up to a point: a CC header
    behind many lone "C"s (values, timestamps) still takes its message out of the run."""
    def test(s: Session, broker: Any) -> None:
        vh = broker.vhosts["/"]
        for name in ("hq", "other"):
            s.receive_data(pframe.marshal(commands.Queue.Declare(queue=name), 1))
        s.receive_data(_headers_burst("", "hq", 30, lambda i: {"a": "CxCxCxCxCxCxCxCxCxCx", "n": i,
                                                               **({"CC": ["other"]} if i == 29 else {})}))
        assert vh.queues["hq"].message_count == 30 and vh.queues["other"].message_count == 1

    _session(tmp_path, test)


def test_a_run_through_a_headers_exchange_routes_each_message_by_its_headers(tmp_path: Path) -> None:
    def test(s: Session, broker: Any) -> None:
        vh = broker.vhosts["/"]
        s.receive_data(pframe.marshal(commands.Exchange.Declare(exchange="hx", exchange_type="headers"), 1))
        for name, colour in (("red", "r"), ("blue", "b")):
            s.receive_data(pframe.marshal(commands.Queue.Declare(queue=name), 1))
            s.receive_data(pframe.marshal(commands.Queue.Bind(queue=name, exchange="hx", arguments={
                "x-match": "all", "colour": colour}), 1))
        s.receive_data(_headers_burst("hx", "", 90, lambda i: {"colour": "rb"[i % 3 == 0]}))
        assert _drain(vh.queues["blue"]) == [b"m-%05d" % i for i in range(0, 90, 3)]
        assert _drain(vh.queues["red"]) == [b"m-%05d" % i for i in range(90) if i % 3]
        # equal headers in a run are routed once and for all
        s.receive_data(_burst("hx", "", 50, commands.Basic.Properties(headers={"colour": "r"})))
        assert _drain(vh.queues["red"]) == _bodies(50) and vh.queues["blue"].message_count == 0

    _session(tmp_path, test)


def test_a_run_reaching_a_delayed_exchange_through_a_binding_is_delayed_whole(tmp_path: Path) -> None:
    """An exchange behaviour on the route (here a delay) applies to each message of a run,
    bodies and all; routing the run once must not feed it a stand-in."""
    def test(s: Session, broker: Any) -> None:
        vh = broker.vhosts["/"]
        s.receive_data(pframe.marshal(commands.Exchange.Declare(
            exchange="dx", exchange_type="x-delayed-message", arguments={"x-delayed-type": "direct"}), 1))
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="dq"), 1))
        s.receive_data(pframe.marshal(commands.Queue.Bind(queue="dq", exchange="dx", routing_key="k"), 1))
        s.receive_data(pframe.marshal(commands.Exchange.Declare(exchange="src", exchange_type="direct"), 1))
        s.receive_data(pframe.marshal(commands.Exchange.Bind(destination="dx", source="src",
                                                             routing_key="k"), 1))
        for props in (commands.Basic.Properties(headers={"x-delay": 60_000}), None):
            s.receive_data(_burst("src", "k", 30, props))
        assert vh.exchanges["dx"].special.delayed.count == 30
        assert _drain(vh.queues["dq"]) == _bodies(30)
        s.receive_data(_headers_burst("src", "k", 30, lambda i: {"x-delay": 60_000 + i}))
        assert vh.exchanges["dx"].special.delayed.count == 60
        assert vh.queues["dq"].message_count == 0

    _session(tmp_path, test)


def test_a_batch_of_routing_keys_keeps_each_queues_order_and_syncs_per_queue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishes in a row to one exchange with routing keys of their own are one batch
    (``publish_batch``): each queue gets its part in publish order, and a confirm waits for
    the group commit only when a persistent message reached a durable queue."""
    from broker.model import publish as publishing
    batches: list[int] = []
    real = publishing.publish_batch

    def counting(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        batches.append(out.done - (a[6] if len(a) > 6 else 0))
        return out

    monkeypatch.setattr(publishing, "publish_batch", counting)

    def props(i: int, mode: int) -> commands.Basic.Properties:
        return commands.Basic.Properties(message_id=f"id-{i}", delivery_mode=mode)

    def test(s: Session, broker: Any) -> None:
        s.receive_data(pframe.marshal(commands.Exchange.Declare(exchange="t", exchange_type="topic"), 1))
        for name, key, durable in (("dq", "d.*", True), ("tq", "t.*", False)):
            s.receive_data(pframe.marshal(commands.Queue.Declare(queue=name, durable=durable), 1))
            s.receive_data(pframe.marshal(commands.Queue.Bind(queue=name, exchange="t", routing_key=key), 1))
        s.receive_data(pframe.marshal(commands.Confirm.Select(), 1))
        s.receive_data(_publish("t", "t.0", b"first", props(0, 1)))  # the exchange's first: alone
        chs = s.chs[1]
        # persistent only into the transient queue: no sync
        chs.needs_sync = False
        s.receive_data(_publish("t", "t.1", b"a", props(1, 2)) + _publish("t", "d.1", b"b", props(2, 1))
                       + _publish("t", "t.2", b"c", props(3, 2)))
        assert not chs.needs_sync and batches == [3]
        # one persistent message into the durable queue, behind a key it shares with others
        s.receive_data(_publish("t", "d.1", b"d", props(4, 1)) + _publish("t", "t.1", b"e", props(5, 1))
                       + _publish("t", "d.1", b"f", props(6, 2)) + _publish("t", "x.1", b"g", props(7, 2))
                       + _publish("t", "d.1", b"h", props(8, 1)))
        assert chs.needs_sync and batches == [3, 5]
        chs.needs_sync = False  # and alone in its queue's part of the batch
        s.receive_data(_publish("t", "d.2", b"i", props(9, 2)) + _publish("t", "t.3", b"j", props(10, 1)))
        assert chs.needs_sync and batches == [3, 5, 2]
        vh = broker.vhosts["/"]
        want_in = {"dq": [b"b", b"d", b"f", b"h", b"i"], "tq": [b"first", b"a", b"c", b"e", b"j"]}
        for name, want in want_in.items():
            got = []
            while (m := vh.queues[name].get()) is not None:
                got.append(m[4])
            assert got == want, name
        assert vh.n_unroutable == 1 and s.stats.published == 11

    _session(tmp_path, test)
