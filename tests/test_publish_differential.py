"""Differential property test of the publish and delivery fast paths (issue 13).

Hypothesis draws a sequence of read batches: publishes with varying properties (none, a
message-id per message, headers, a CC header, an expiration, a priority), empty bodies, bodies around the
frame_max boundary, mandatory to nowhere, on several channels in plain, confirm and tx mode
(also one publish per channel, channels in turn, in one read: issue 31's many queues), into a
plain queue, queues with features (with and without per-message work), a priority queue and a
quorum queue (directly, through a fanout exchange, and through a topic exchange with
routing keys that change from publish to publish, and through a deduplicating exchange with
some messages repeating the one before's deduplication header), with autoack and manual-ack
consumers at varying prefetch that ack after each batch: with one multiple ack per channel, or
with a single ack of each delivery, all channels' in one read (the ack run of issue 31), once
with a tag repeated in the middle (the channel fails there, as a lone ack would fail it).
Each sequence runs twice on a fresh broker: once as shipped (one-pass parse, publish runs,
direct hand-over, delivery runs) and once with all of that forced off (the parser's
``fast_paths`` and the vhost's ``FastPaths`` switch, both owned by this test; with them off, the
parser decodes every basic.publish's arguments afresh, not from its per-connection cache). What
the clients see must be identical: every byte delivered, returned and confirmed, and the queue
counts. It must also be what the spec says: every message published to a queue is delivered or still in
it, in publish order except where priorities reorder.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from _amqp_session import Client, close_node, make_node, publish_frames, pump
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp import frame as pframe

FRAME_MAX = 4096
BODY_MAX = FRAME_MAX - 8  # payload of one body frame
QUEUES = {
    "plain": {},
    "feat": {"x-message-ttl": 3_600_000},
    "prio": {"x-max-priority": 5},
    "lim": {"x-max-length": 100_000},  # featured, without per-message work: delivered in runs
    "quorum": {"x-queue-type": "quorum"},  # two priority levels: runs while one level waits
}
# topic exchange "top": target -> (routing key, the queues it reaches); publishes in a row to it
# with other keys are a batch (one exchange, keys of their own)
TOPIC = {"top-a": ("a.x", ["plain"]), "top-ab": ("a.b", ["plain", "lim"]), "top-p": ("p.q", ["prio"]),
         "top-f": ("f.x", ["feat"]), "top-none": ("z.z", [])}
TOPIC_BINDINGS = (("plain", "a.*"), ("lim", "*.b"), ("prio", "p.#"), ("feat", "f.*"))
PROPS = ("none", "ids", "headers", "cc", "expiration", "priority", "dedup")
DEDUP_TARGET = "dd"  # a direct exchange with x-message-deduplication, bound to "plain" by key "d"
DEDUP_NOWHERE = "dd-none"  # the same exchange, routing key "z" (bound to nothing)
BODIES = ("empty", "small", "frame-1", "frame", "frame+1", "two-frames")
MODES = ("plain", "confirm", "tx")

publish_st = st.tuples(
    st.integers(1, 3),  # channel
    st.sampled_from(("plain", "feat", "prio", "lim", "fan", "nowhere",  # target
                     DEDUP_TARGET, DEDUP_NOWHERE, *TOPIC)),
    st.sampled_from(PROPS),
    st.sampled_from(BODIES),
    st.booleans(),  # mandatory
    st.integers(1, 6),  # repeated this many times in a row (a run when they match)
)
scenario_st = st.fixed_dictionaries({
    "modes": st.tuples(*(st.sampled_from(MODES) for _ in range(3))),
    "consumers": st.fixed_dictionaries({
        name: st.sampled_from((None, "autoack", 1, 2, 3, 10, 0)) for name in QUEUES
    }),
    "consume_after": st.integers(0, 3),  # consumers start after this many batches
    "batches": st.lists(st.lists(publish_st, min_size=1, max_size=6), min_size=1, max_size=5),
    "rollback": st.booleans(),  # tx channels roll back their last batch instead of committing
    "one_channel": st.booleans(),  # every publish on channel 1: publishes in a row to one exchange
    "acks": st.sampled_from(("multiple", "each", "each-bad")),
})


def _body(kind: str, n: int) -> bytes:
    size = {"empty": 0, "small": 1 + n % 40, "frame-1": BODY_MAX - 1, "frame": BODY_MAX,
            "frame+1": BODY_MAX + 1, "two-frames": 2 * BODY_MAX + 3}[kind]
    stamp = b"%06d" % n
    return (stamp * (size // len(stamp) + 1))[:size]


def _props(kind: str, n: int) -> commands.Basic.Properties:
    if kind == "ids":
        return commands.Basic.Properties(message_id=f"id-{n}", content_type="text/plain")
    if kind == "headers":
        return commands.Basic.Properties(headers={"n": n % 3, "tag": "x"})
    if kind == "cc":  # also routed to the plain queue
        return commands.Basic.Properties(headers={"n": n, "CC": ["plain"]})
    if kind == "expiration":
        return commands.Basic.Properties(expiration="3600000")
    if kind == "priority":
        return commands.Basic.Properties(priority=n % 6)
    if kind == "dedup":  # pairs of messages in a row share a key: the second is a duplicate
        return commands.Basic.Properties(delivery_mode=2, headers=_dedup_headers(n))
    return commands.Basic.Properties()


def _dedup_headers(n: int) -> dict[str, Any]:
    return {"x-deduplication-header": f"d{n // 2}"}


async def _play(node: Any, sc: dict[str, Any], fast: bool) -> dict[str, Any]:
    node.vhosts["/"].fast.on = fast
    pub = Client(node, FRAME_MAX)
    con = Client(node, FRAME_MAX)
    for c in (pub, con):
        c.session.fast_paths = fast
    pub.open(1)
    for name, args in QUEUES.items():
        pub.method(commands.Queue.Declare(queue=name, durable=name == "quorum", arguments=args))
    pub.method(commands.Exchange.Declare(exchange="fan", exchange_type="fanout"))
    for name in QUEUES:
        pub.method(commands.Queue.Bind(queue=name, exchange="fan"))
    pub.method(commands.Exchange.Declare(exchange="top", exchange_type="topic"))
    for name, key in TOPIC_BINDINGS:
        pub.method(commands.Queue.Bind(queue=name, exchange="top", routing_key=key))
    pub.method(commands.Exchange.Declare(exchange=DEDUP_TARGET, exchange_type="direct", arguments={
        "x-message-deduplication": True, "x-cache-size": 1000}))
    pub.method(commands.Queue.Bind(queue="plain", exchange=DEDUP_TARGET, routing_key="d"))
    dedup_seen: set[str] = set()

    def apply(into: list[str], body: bytes, key: str | None) -> None:
        """A publish as the broker applies it: into ``into`` unless the deduplicating exchange
        has seen its key (looked up, and remembered, whether it then reaches a queue or not)."""
        if key is not None:
            if key in dedup_seen:
                return
            dedup_seen.add(key)
        for name in into:
            expected[name].append(body)

    for ch, mode in zip((1, 2, 3), sc["modes"], strict=True):
        if ch != 1:
            pub.open(ch)
        if mode == "confirm":
            pub.method(commands.Confirm.Select(), ch)
        elif mode == "tx":
            pub.method(commands.Tx.Select(), ch)
    expected: dict[str, list[bytes]] = {name: [] for name in QUEUES}
    manual: dict[int, int] = {}  # consumer channel -> last delivery tag acked
    bad: list[int] = []  # the channel an "each-bad" scenario acked a tag twice on

    def start_consumers() -> None:
        for i, (name, how) in enumerate(sc["consumers"].items(), start=1):
            if how is None:
                continue
            con.open(i)
            if how != "autoack":
                con.method(commands.Basic.Qos(prefetch_count=how), i)
                manual[i] = 0
            con.method(commands.Basic.Consume(queue=name, consumer_tag=name, no_ack=how == "autoack"), i)

    async def ack_all() -> bool:
        """Each manual-ack consumer acks everything it got so far; True if any did."""
        await pump(node)
        con.read()
        acked = False
        each: list[bytes] = []  # single acks: every channel's in one read
        for ch, done in list(manual.items()):
            tags = [d.tag for d in con.seen.deliveries if d.channel == ch]
            if tags and tags[-1] > done:
                if sc.get("acks", "multiple") == "multiple":
                    con.method(commands.Basic.Ack(delivery_tag=tags[-1], multiple=True), ch)
                else:
                    new = [t for t in tags if t > done]
                    if sc["acks"] == "each-bad" and len(new) > 1 and not bad:
                        new.insert(len(new) // 2 + 1, new[len(new) // 2])  # repeated: unknown the 2nd time
                        bad.append(ch)
                    each += [pframe.marshal(commands.Basic.Ack(delivery_tag=t), ch) for t in new]
                manual[ch] = tags[-1]
                acked = True
        if each:
            con.send(b"".join(each))
        for ch in bad:  # its channel is closed now
            manual.pop(ch, None)
        await pump(node)
        return acked

    n = 0
    batches = sc["batches"]
    for b, batch in enumerate(batches):
        if b == sc["consume_after"]:
            start_consumers()
        data = []
        # each tx channel's publishes in order (queues, body, deduplication key or None), applied
        # when it commits
        pending_tx: dict[int, list[tuple[list[str], bytes, str | None]]] = {ch: [] for ch in (1, 2, 3)}
        for ch, target, pkind, bkind, mandatory, times in batch:
            if sc.get("one_channel"):
                ch = 1
            for _ in range(times):
                n += 1
                body = _body(bkind, n if pkind != "none" else 0)
                key = None
                if target in TOPIC:
                    exchange, (rk, into) = "top", TOPIC[target]
                    into = list(into)
                elif target in (DEDUP_TARGET, DEDUP_NOWHERE):
                    exchange, rk = DEDUP_TARGET, "d" if target == DEDUP_TARGET else "z"
                    into = ["plain"] if target == DEDUP_TARGET else []
                    if pkind == "dedup":
                        key = _dedup_headers(n)["x-deduplication-header"]
                else:
                    exchange, rk = ("fan", "") if target == "fan" else ("", target)
                    into = list(QUEUES) if target == "fan" else ([target] if target in QUEUES else [])
                data.append(publish_frames(exchange, rk, body, _props(pkind, n), ch, mandatory, FRAME_MAX))
                if pkind == "cc" and "plain" not in into and exchange not in ("top", DEDUP_TARGET):
                    into.append("plain")  # ("plain" binds no other key there)
                if sc["modes"][ch - 1] == "tx":
                    pending_tx[ch].append((into, body, key))
                else:
                    apply(into, body, key)
        for ch, mode in zip((1, 2, 3), sc["modes"], strict=True):
            if mode == "tx":
                last = b == len(batches) - 1
                method = commands.Tx.Rollback() if last and sc["rollback"] else commands.Tx.Commit()
                data.append(pframe.marshal(method, ch))
        if not (sc["rollback"] and b == len(batches) - 1):
            for ch in (1, 2, 3):  # committed in channel order, after the batch's other publishes
                for into, body, key in pending_tx[ch]:
                    apply(into, body, key)
        pub.send(b"".join(data))
        await pump(node)
        await ack_all()
    if sc["consume_after"] >= len(batches):
        start_consumers()
    for _ in range(200):  # ack until the consumers have taken everything they can
        if not await ack_all():
            break
    await pump(node)
    pub.read()
    con.read()
    vh = node.vhosts["/"]
    counts = {name: (q.message_count, q.store.unacked_count, q.n_published, q.n_delivered)
              for name, q in vh.queues.items()}
    remaining: dict[str, list[bytes]] = {}
    for name, q in vh.queues.items():
        bodies = []
        while (m := q.get()) is not None:
            bodies.append(m[4])
            q.ack(m[0])
        remaining[name] = bodies
    # per channel, in order (channels' confirms of one batch go out in no particular order)
    confirms = sorted(((ch, i, type(m).__name__, int(m.delivery_tag), bool(m.multiple))
                       for i, (ch, m) in enumerate(pub.seen.methods)
                       if isinstance(m, commands.Basic.Ack | commands.Basic.Nack)), key=lambda c: c[0])
    confirms = [(ch, name, tag, multiple) for ch, _, name, tag, multiple in confirms]
    others = [(ch, type(m).__name__) for ch, m in pub.seen.methods + con.seen.methods
              if not isinstance(m, commands.Basic.Ack | commands.Basic.Nack)]
    # per consumer (one per channel): how deliveries to different channels interleave on the
    # connection is up to the broker (a hand-over at publish time vs. a later delivery pass)
    deliveries = sorted((d.channel, d.tag, d.consumer_tag, d.exchange, d.routing_key, d.redelivered, d.props,
                         d.body) for d in con.seen.deliveries)
    returns = [(ch, int(m.reply_code), m.exchange, m.routing_key, body) for ch, m, body in pub.seen.returns]
    stats = node.stats
    return {
        "deliveries": deliveries, "confirms": confirms, "returns": returns, "methods": others,
        "counts": counts, "remaining": remaining, "expected": expected,
        "stats": (stats.published, stats.delivered, stats.unroutable, stats.confirmed),
    }


def _run(sc: dict[str, Any], fast: bool) -> dict[str, Any]:
    async def main(tmp: Path) -> dict[str, Any]:
        node = make_node(tmp)
        try:
            return await _play(node, sc, fast)
        finally:
            close_node(node)

    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(main(Path(tmp)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_st)
@example({  # publishes in a row to one exchange with routing keys of their own: batches
    "modes": ("plain", "confirm", "plain"),
    "consumers": {"plain": "autoack", "feat": None, "prio": 10, "lim": 4, "quorum": None},
    "consume_after": 0, "rollback": False,
    "batches": [[(1, "top-a", "ids", "small", True, 1), (1, "top-ab", "ids", "small", True, 1),
                 (1, "top-none", "ids", "small", True, 1), (1, "top-p", "ids", "small", False, 1),
                 (2, "top-a", "ids", "small", True, 1), (2, "top-ab", "ids", "small", True, 2),
                 (2, "top-none", "headers", "small", True, 1), (2, "top-f", "ids", "small", False, 1),
                 (2, "top-a", "expiration", "small", False, 1), (2, "top-ab", "cc", "small", True, 1),
                 (3, "plain", "none", "small", True, 1), (3, "lim", "none", "small", True, 1),
                 (3, "nowhere", "none", "small", True, 1), (3, "prio", "priority", "small", True, 1)]] * 2,
})
@example({  # a backlog of equal empty-body messages, then an autoack consumer (issue 13)
    "modes": ("plain", "plain", "plain"),
    "consumers": {"plain": "autoack", "feat": None, "prio": None, "lim": None},
    "consume_after": 1, "rollback": False,
    "batches": [[(1, "plain", "none", "empty", False, 3)], [(1, "plain", "none", "small", False, 1)]],
})
@example({  # the same to a manual-ack consumer with a prefetch over 1
    "modes": ("confirm", "plain", "plain"),
    "consumers": {"plain": 3, "feat": None, "prio": None, "lim": None},
    "consume_after": 1, "rollback": False,
    "batches": [[(1, "plain", "none", "empty", False, 5)], [(1, "fan", "none", "empty", False, 2)]],
})
@example({  # a priority backlog with equal messages per level, then runs to one consumer of each
    "modes": ("plain", "confirm", "plain"),
    "consumers": {"plain": None, "feat": None, "prio": 10, "lim": 4},
    "consume_after": 3, "rollback": False,
    "batches": [[(1, "prio", "priority", "empty", False, 6), (2, "lim", "none", "small", False, 5)]] * 3,
})
@example({  # runs through a deduplicating exchange, duplicates inside a run and across channels
    "modes": ("confirm", "tx", "plain"),
    "consumers": {"plain": 2, "feat": None, "prio": None, "lim": None, "quorum": None},
    "consume_after": 1, "rollback": False, "one_channel": False,
    "batches": [[(1, "dd", "dedup", "small", True, 5), (2, "dd", "dedup", "small", False, 3),
                 (3, "dd", "dedup", "small", True, 4), (1, "dd", "ids", "small", True, 2)],
                [(1, "dd", "dedup", "empty", False, 3), (1, "dd", "dedup", "small", False, 1),
                 (3, "dd", "headers", "small", True, 3), (1, "dd", "dedup", "frame+1", True, 2)],
                [(1, "dd", "dedup", "small", True, 1), (1, "dd-none", "dedup", "small", True, 1),
                 (1, "dd", "dedup", "small", True, 2), (1, "dd-none", "dedup", "small", False, 2),
                 (1, "dd", "ids", "small", False, 1), (1, "dd-none", "none", "small", True, 1)]],
})
@example({  # single acks of each delivery on two channels in one read, a tag repeated (issue 31)
    "modes": ("plain", "plain", "plain"),
    "consumers": {"plain": 10, "feat": None, "prio": None, "lim": 5, "quorum": None},
    "consume_after": 0, "rollback": False, "acks": "each-bad",
    "batches": [[(1, "plain", "ids", "small", False, 6), (1, "lim", "none", "small", False, 4)]] * 2,
})
@example({  # one publish per channel, channels in turn, all in one read (issue 31's 1,000 queues):
    # keys that change from publish to publish, the same key with and without mandatory
    "modes": ("plain", "confirm", "plain"),
    "consumers": {"plain": "autoack", "feat": None, "prio": None, "lim": 3, "quorum": None},
    "consume_after": 0, "rollback": False,
    "batches": [[(1, "plain", "ids", "small", False, 1), (2, "lim", "none", "small", True, 1),
                 (3, "nowhere", "none", "small", True, 1), (1, "nowhere", "ids", "small", False, 1),
                 (2, "plain", "headers", "small", False, 1), (3, "nowhere", "none", "small", False, 1),
                 (1, "nowhere", "none", "small", True, 1), (2, "feat", "ids", "small", False, 1)]] * 2,
})
def test_fast_paths_change_nothing_a_client_sees(sc: dict[str, Any]) -> None:
    fast = _run(sc, True)
    slow = _run(sc, False)
    for key in ("deliveries", "confirms", "returns", "methods", "counts", "remaining", "stats"):
        assert fast[key] == slow[key], key
    # and what the spec says: every message a queue took is delivered or still there
    delivered: dict[str, list[bytes]] = {name: [] for name in QUEUES}
    for d in fast["deliveries"]:
        delivered[d[2]].append(d[7])
    for name in QUEUES:
        got = delivered[name] + fast["remaining"][name]
        if sc.get("acks") == "each-bad":  # a closed channel's unacked deliveries went back, and again
            assert set(got) == set(fast["expected"][name]), name
        elif name in ("prio", "quorum"):
            assert sorted(got) == sorted(fast["expected"][name])
        else:
            assert got == fast["expected"][name], name
