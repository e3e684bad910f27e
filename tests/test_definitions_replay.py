"""A vhost's definitions log at boot: what compaction writes replays without a refusal, and
topic bindings without wildcards cost no compiled pattern (no sockets: a VHost on a temporary
directory). Ten thousand MQTT sessions (a durable queue and a topic binding each) took 12 s to
replay on a loaded machine, a fifth of it logging a refused default-exchange binding per queue
that compaction had written, a quarter compiling an RE2 program per literal binding key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pamqp import frame as pframe

from broker.model import methods, policy
from broker.model.definition_records import QUEUE_BIND, decode, plain
from broker.model.exchange import topic_regex
from broker.model.vhost import VHost
from broker.patterns import Pattern
from broker.store.sink import NullSink


def _vhost(tmp: Path) -> VHost:
    return VHost("/", tmp / "data", segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: cb(),
                 mark_dirty=lambda _obj: None, transient_root=tmp / "transient")


def test_compacted_log_replays_without_refusals(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    vh = _vhost(tmp_path)
    for i in range(3):
        vh.declare_queue(f"mqtt-subscription-c{i}qos1", durable=True, owner=None)
        vh.bind_queue(f"mqtt-subscription-c{i}qos1", "amq.topic", f"sess.{i}", {}, owner=None)
    vh.compact()
    vh.definitions.close()
    exchanges = [getattr(decode(r), "exchange", None) for r in vh.definitions.load()]
    assert "" not in exchanges, "compaction wrote the default exchange's implicit bindings"
    with caplog.at_level(logging.WARNING, logger="broker.model.vhost"):
        again = _vhost(tmp_path)
    assert not [r for r in caplog.records if "definition record" in r.getMessage()]
    assert set(again.queues) == {f"mqtt-subscription-c{i}qos1" for i in range(3)}
    topic = again.exchanges["amq.topic"]
    assert sorted(k for _, k, _ in topic.bindings()) == ["sess.0", "sess.1", "sess.2"]
    assert again.exchanges[""].is_bound(again.queues["mqtt-subscription-c0qos1"], "mqtt-subscription-c0qos1")


def test_an_old_logs_default_exchange_bindings_are_skipped_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A log compacted before the fix holds them: the replay passes over them without a word."""
    vh = _vhost(tmp_path)
    vh.declare_queue("q", durable=True, owner=None)
    vh.definitions.append(pframe.marshal(methods.QueueBind(queue="q", exchange="", routing_key="q",
                                                            arguments={}), 0))
    vh.definitions.close()
    with caplog.at_level(logging.WARNING, logger="broker.model.vhost"):
        again = _vhost(tmp_path)
    assert not [r for r in caplog.records if "definition record" in r.getMessage()]
    assert "q" in again.queues


def test_literal_topic_keys_compile_no_pattern() -> None:
    assert not isinstance(topic_regex("sess.17"), Pattern)
    assert not isinstance(topic_regex("a.*x.b#"), Pattern)  # '*x' and 'b#' are words, not wildcards
    assert isinstance(topic_regex("sess.*"), Pattern) and isinstance(topic_regex("sess.#"), Pattern)
    assert topic_regex("sess.17").fullmatch(".sess.17") and not topic_regex("sess.17").fullmatch(".sess.1")


def _snapshot(vh: VHost) -> dict[str, object]:
    """What a client or the API can tell of a vhost's queues and bindings."""
    queues = {}
    for name, q in vh.queues.items():
        features = getattr(q, "features", None)
        # a replayed plain queue's store reads its directory on first use (DeferredQueueStore)
        store = type(getattr(q, "store", None)).__name__.removeprefix("Deferred")
        queues[name] = (type(q).__name__, store, q.durable, q.auto_delete,
                        q.exclusive_owner, dict(q.arguments), getattr(q, "paused", None),
                        getattr(features, "cfg", None))
    bindings = sorted((ex.name, getattr(dest, "name", ""), rk, sorted(args.items()))
                      for ex in vh.exchanges.values() if ex.name for dest, rk, args in ex.bindings())
    default = sorted(rk for _, rk, _ in vh.exchanges[""].bindings())
    exchanges = {n: (ex.type, ex.durable, ex.auto_delete, ex.internal, dict(ex.arguments), ex.alternate)
                 for n, ex in vh.exchanges.items()}
    return {"queues": queues, "bindings": bindings, "default": default, "exchanges": exchanges}


def test_a_replayed_queue_is_the_declared_one(tmp_path: Path) -> None:
    """A differential check of the boot's replay (its plain records read without pamqp, their
    argument parsing done once): the vhost reopened on the same directory holds queues,
    bindings and exchanges indistinguishable from the ones declared, policies applied alike."""
    vh = _vhost(tmp_path)
    policy.set_policy(vh, "lim", "^pol\\.", {"max-length": 5, "message-ttl": 60000})
    vh.declare_exchange("x.direct", "direct", durable=True, auto_delete=False, internal=False, arguments={})
    vh.declare_exchange("x.headers", "headers", durable=True, auto_delete=False, internal=False, arguments={})
    vh.declare_exchange("x.fan", "fanout", durable=True, auto_delete=True, internal=False,
                        arguments={"alternate-exchange": "x.direct"})
    declared: list[tuple[str, bool, dict[str, object]]] = [
        ("mqtt-subscription-c1qos1", False, {}),  # a plain record
        ("plain.auto", True, {}),  # a plain record, auto-delete
        ("pol.q", False, {}),  # plain, with a policy
        ("args.q", False, {"x-max-length": 3, "x-overflow": "reject-publish", "x-message-ttl": 1000}),
        ("prio.q", False, {"x-max-priority": 4}),
        ("quorum.q", False, {"x-queue-type": "quorum"}),
        ("pol.args", False, {"x-max-length": 9}),
    ]
    for name, auto_delete, arguments in declared:
        vh.declare_queue(name, durable=True, auto_delete=auto_delete, arguments=arguments, owner=None)
    vh.bind_queue("mqtt-subscription-c1qos1", "amq.topic", "a.*.c", {}, owner=None)
    vh.bind_queue("mqtt-subscription-c1qos1", "amq.topic", "a.#", {}, owner=None)
    vh.bind_queue("plain.auto", "x.direct", "k", {}, owner=None)
    vh.bind_queue("pol.q", "x.headers", "", {"x-match": "any", "h": "1"}, owner=None)
    vh.bind_queue("args.q", "x.fan", "", {}, owner=None)
    vh.bind_exchange("x.fan", "amq.direct", "e2e", {})
    vh.pause_queue("prio.q", True)
    vh.pause_queue("pol.q", True)
    vh.pause_queue("pol.q", False)
    before = _snapshot(vh)
    vh.definitions.close()
    again = _vhost(tmp_path)
    assert _snapshot(again) == before
    again.compact()  # and what compaction writes replays to the same again
    again.definitions.close()
    assert _snapshot(_vhost(tmp_path)) == before


def test_plain_records_read_only_what_pamqp_reads() -> None:
    """Each byte of a plain bind and declare record changed, and each cut short: what the boot's
    reader takes (``plain`` not None) pamqp reads to the same fields; the rest goes to pamqp."""
    records = [pframe.marshal(methods.QueueBind(queue="q1", exchange="amq.topic", routing_key="a.#"), 0),
               pframe.marshal(methods.QueueDeclare(queue="mqtt-subscription-cqos1", durable=True), 0)]
    for record in records:
        variants = [record[:n] for n in range(len(record))]
        variants += [record[:i] + bytes([v]) + record[i + 1:]
                     for i in range(len(record)) for v in (0, 1, 0x7F, 0xFF)]
        for v in variants:
            fields = plain(v)
            if fields is None:
                continue
            _, _, theirs = pframe.unmarshal(v)
            kind, queue, exchange, routing_key, bits = fields
            assert theirs.queue == queue
            if kind == QUEUE_BIND:
                assert (theirs.exchange, theirs.routing_key) == (exchange, routing_key)
                assert theirs.nowait == bool(bits & 1)
            else:
                flags = (theirs.passive, theirs.durable, theirs.auto_delete)
                assert flags == (bool(bits & 1), bool(bits & 2), bool(bits & 8))
            assert not theirs.arguments


def test_a_queue_deleted_and_declared_again_keeps_its_messages_across_a_boot(tmp_path: Path) -> None:
    """The log holds declare, delete, declare of one name: replaying the delete must not remove
    the directory, which holds the second queue's messages (it did, on a restart after any
    delete and declare again of a name; names deleted for good go once the log is read)."""
    from broker.store import segment_log
    from broker.store.paths import queue_dir

    vh = _vhost(tmp_path)
    for name in ("again", "gone"):
        q, _ = vh.declare_queue(name, durable=True, owner=None)
        q.store.append(1, b"", b"q", b"\x10\x00\x02", b"old")
    vh.delete_queue("again", owner=None)
    vh.delete_queue("gone", owner=None)
    q, _ = vh.declare_queue("again", durable=True, owner=None)
    q.store.append(1, b"", b"q", b"\x10\x00\x02", b"new")
    q.store.sync()
    segment_log._spare_worker().submit(lambda: None).result(30)
    vh.close()
    gone = queue_dir(vh.dir, "gone")
    gone.mkdir()  # as a crash between the delete's record and its rename leaves it
    (gone / "msgs.0000000001").write_bytes(b"stale")
    again = _vhost(tmp_path)
    store = again.queues["again"].store
    msgid = store.shift()
    assert msgid is not None and store.read(msgid)[4] == b"new" and store.shift() is None
    assert "gone" not in again.queues and not gone.exists()
    again.close()


def test_a_delayed_exchange_deleted_and_declared_again_keeps_its_messages_across_a_boot(
        tmp_path: Path) -> None:
    """The same for a delayed-message exchange's held messages (``delayed/`` under the vhost):
    replaying an exchange.delete must not remove the files of the exchange declared again
    later in the log; an exchange deleted for good has a crash's leftover directory removed
    once the log is read, and one declared again with another type has its old files buried."""
    from broker.store import segment_log
    from broker.store.paths import queue_dir
    from broker.store.queue_store import QueueStore

    args = {"x-delayed-type": "direct"}
    vh = _vhost(tmp_path)
    for name in ("again", "gone", "retyped"):
        vh.declare_exchange(name, "x-delayed-message", durable=True, arguments=args)
        special = vh.exchanges[name].special
        assert special is not None and special.delayed is not None
        special.delayed.add(1, 3_600_000, "k", b"\x10\x00\x02", b"old")
        vh.delete_exchange(name)
    vh.declare_exchange("again", "x-delayed-message", durable=True, arguments=args)
    vh.declare_exchange("retyped", "direct", durable=True)
    special = vh.exchanges["again"].special
    assert special is not None and special.delayed is not None
    special.delayed.add(1, 3_600_000, "k", b"\x10\x00\x02", b"new")
    special.delayed.store.sync()
    segment_log._spare_worker().submit(lambda: None).result(30)
    vh.close()
    delayed = vh.dir / "delayed"
    for name in ("gone", "retyped"):  # as a crash between the delete's record and its rename leaves them
        left = QueueStore(queue_dir(delayed, name), segment_size=64 * 1024, sink=NullSink())
        left.append(1, name.encode(), b"k", b"\x10\x00\x02", b"stale")
        left.close()
    again = _vhost(tmp_path)
    special = again.exchanges["again"].special
    assert special is not None and special.delayed is not None
    held = special.delayed
    assert held.count == 1, "the exchange declared again lost its held message at the boot"
    assert held.store.read(held.heap[0][2])[4] == b"new"
    assert "gone" not in again.exchanges and again.exchanges["retyped"].type == "direct"
    assert not queue_dir(delayed, "gone").exists() and not queue_dir(delayed, "retyped").exists()
    again.close()
