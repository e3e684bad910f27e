"""Replication scoped by shard (issue 27, the data path): one follower follows two senders
into one data directory, each for its own shards, the way a node follows the leader of each
shard for that shard alone (and the cluster leader for the shared files).

Real ``LeaderSink``s listen on 127.0.0.1 in this process and the real ``follower.follow``
replicates from them over real sockets into real files; every wait polls with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest

from broker.cluster import codec, follower
from broker.cluster.files import EVERYTHING, Scope, shard_name
from broker.cluster.follow_set import FollowSet, Sender, follow_plan
from broker.cluster.follower import Applier
from broker.cluster.leader import FollowerConn, LeaderSink
from broker.cluster.shard_sink import ShardedLeaderSink

SECRET = b"s" * 32
DEADLINE = 20.0  # seconds: generous under load
VA, VB, VC = (shard_name(v) for v in ("va", "vb", "vc"))


async def _isr(members: list[str]) -> bool:
    return True


def _write(root: Path, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def _until(what: str, ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE}s: {what}")
        await asyncio.sleep(0.02)


def test_a_follower_of_two_senders_takes_from_each_only_its_scope(tmp_path: Path) -> None:
    a_dir, b_dir, f_dir = (tmp_path / n for n in ("a", "b", "f"))
    # A leads va and holds the shared files; B leads vb. Each also has an older copy of the
    # other's shard (a replica), which the follower must not take from it.
    _write(a_dir, "users.json", b'{"users": 2}')
    _write(a_dir, f"{VA}/q/msgs.1", b"HEADa1")
    _write(a_dir, f"{VB}/q/msgs.1", b"HEADold")
    _write(b_dir, "users.json", b'{"users": 1}')
    _write(b_dir, f"{VB}/q/msgs.1", b"HEADb1b2")
    # The follower: a stale shared file, and a shard neither sender serves it (its own).
    _write(f_dir, "users.json", b'{"users": 0}')
    _write(f_dir, f"{VC}/q/msgs.1", b"HEADmine")

    async def scenario() -> None:
        a = LeaderSink(a_dir, "A", SECRET, _isr)
        b = LeaderSink(b_dir, "B", SECRET, _isr)
        a.index.scan()
        b.index.scan()
        _, a_port = await a.start("127.0.0.1", 0)
        _, b_port = await b.start("127.0.0.1", 0)
        synced: set[str] = set()
        pools = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]
        tasks = [
            asyncio.ensure_future(follower.follow(
                "127.0.0.1", a_port, f_dir, SECRET, "F", lambda w: None, lambda: synced.add("A"), pools[0],
                scope=Scope(shared=True, shards=frozenset({VA})))),
            asyncio.ensure_future(follower.follow(
                "127.0.0.1", b_port, f_dir, SECRET, "F", lambda w: None, lambda: synced.add("B"), pools[1],
                scope=Scope(shared=False, shards=frozenset({VB})))),
        ]
        try:
            await _until("both bulk syncs", lambda: synced == {"A", "B"} or any(t.done() for t in tasks))
            assert synced == {"A", "B"}, [t.exception() for t in tasks if t.done()]
            assert (f_dir / "users.json").read_bytes() == b'{"users": 2}'  # the shared files: A's
            assert (f_dir / VA / "q" / "msgs.1").read_bytes() == b"HEADa1"
            assert (f_dir / VB / "q" / "msgs.1").read_bytes() == b"HEADb1b2"  # B's, not A's older copy
            assert (f_dir / VC / "q" / "msgs.1").read_bytes() == b"HEADmine"  # outside both: untouched

            # Live: each sender streams only the follower's scope of it.
            for sink, root, rel, data in ((a, a_dir, f"{VA}/q/msgs.1", b"a2"),
                                          (a, a_dir, f"{VB}/q/msgs.1", b"stale"),
                                          (b, b_dir, f"{VB}/q/msgs.1", b"b3"),
                                          (b, b_dir, "users.json", b"")):
                with open(root / rel, "ab") as fh:
                    fh.write(data)
                sink.append(root / rel, data)
            barriers = [a.barrier(), b.barrier()]
            await _until("the live actions",
                         lambda: (f_dir / VB / "q" / "msgs.1").read_bytes() == b"HEADb1b2b3"
                         and (f_dir / VA / "q" / "msgs.1").read_bytes() == b"HEADa1a2")
            # each sender's ISR names the follower, and its confirms wait for it alone
            await _until("F in both ISRs", lambda: a.isr == {"F"} and b.isr == {"F"})
            await asyncio.wait_for(asyncio.gather(*barriers), DEADLINE)
            assert (f_dir / "users.json").read_bytes() == b'{"users": 2}'
            assert a.followers["F"].scope == Scope(True, frozenset({VA}))
            assert not b.followers["F"].everything
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await a.stop()
            await b.stop()
            for p in pools:
                p.shutdown(wait=True)

    asyncio.run(scenario())


def test_a_path_outside_the_scope_is_refused_before_it_is_written(tmp_path: Path) -> None:
    applier = Applier(tmp_path, Scope(shared=False, shards=frozenset({VA})))
    reader = codec.MessageReader()
    for msg in (codec.encode_append(f"{VB}/q/msgs.1", b"x"), codec.encode_replace("users.json", b"{}"),
                codec.encode_delete(f"{VB}/q/meta"), codec.encode_file_data("vhosts.json", b"x", True),
                codec.encode_file_list([codec.FileInfo(f"{VB}/q/msgs.1", 1, b"h" * 20)])):
        [m] = reader.feed(msg)
        with pytest.raises(codec.CodecError, match="outside the scope"):
            applier.apply(m)
    [m] = reader.feed(codec.encode_append(f"{VA}/q/msgs.1", b"x"))
    applier.apply(m)
    applier.close()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) \
        == [f"{VA}/q/msgs.1"]


def test_scope_on_the_wire_round_trips_and_is_bounded() -> None:
    for scope in (EVERYTHING, Scope(False, None), Scope(True, frozenset()),
                  Scope(False, frozenset({VA, VB})), Scope(True, None, frozenset({VC}))):
        [m] = codec.MessageReader().feed(codec.encode_scope(scope))
        assert m.kind == codec.SCOPE and codec.parse_scope(m.payload) == scope
    for bad in (b"", b"\x04", b"\x01" + b"x" * 19, b"\x02" + b"y" * 21):
        with pytest.raises(codec.CodecError):
            codec.parse_scope(bad)
    with pytest.raises(ValueError):
        codec.encode_scope(Scope(False, frozenset({"not-a-vhost-directory"})))


def test_the_leader_reads_no_oversized_scope(tmp_path: Path) -> None:
    """A scope longer than any real one is refused by its header: the leader reads no further."""
    async def scenario() -> None:
        sink = LeaderSink(tmp_path, "L", SECRET, _isr)
        _, port = await sink.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            oversized = codec.HEAD.pack(codec.SCOPE, codec.SCOPE_MAX_PAYLOAD + 1)
            writer.write(codec.encode_hello(SECRET, "F") + oversized)
            raw = await asyncio.wait_for(reader.readexactly(codec.WELCOME_SIZE), DEADLINE)
            welcome = codec.parse_welcome(raw)
            assert welcome.status == codec.OK
            assert await asyncio.wait_for(reader.read(), DEADLINE) == b""  # closed, nothing sent
            writer.close()
            assert not sink.followers
        finally:
            await sink.stop()

    asyncio.run(scenario())


def test_a_shard_moving_to_another_sender_is_followed_from_its_new_leader(tmp_path: Path) -> None:
    """``FollowSet``: vb is A's, then B's (its new leader): A's link ends (its last batch
    written) before B's opens, B's copy of vb replaces A's, and from then on only B's actions
    of vb reach the follower; two scopes that overlap are refused."""
    a_dir, b_dir, f_dir = (tmp_path / n for n in ("a", "b", "f"))
    _write(a_dir, "users.json", b'{"users": 1}')
    _write(a_dir, f"{VA}/q/msgs.1", b"HEADa1")
    _write(a_dir, f"{VB}/q/msgs.1", b"HEADb1")
    _write(b_dir, f"{VB}/q/msgs.1", b"HEADb1B")  # B's copy, newer than A's (it leads vb now)
    f_dir.mkdir()

    def read(rel: str) -> bytes:
        path = f_dir / rel
        return path.read_bytes() if path.exists() else b""

    def live(sink: LeaderSink, root: Path, rel: str, data: bytes) -> None:
        with open(root / rel, "ab") as fh:
            fh.write(data)
        sink.append(root / rel, data)

    async def scenario() -> None:
        a = LeaderSink(a_dir, "A", SECRET, _isr)
        b = LeaderSink(b_dir, "B", SECRET, _isr)
        a.index.scan()
        b.index.scan()
        sa = Sender("127.0.0.1", (await a.start("127.0.0.1", 0))[1])
        sb = Sender("127.0.0.1", (await b.start("127.0.0.1", 0))[1])
        welcomed: set[Sender] = set()
        pool = ThreadPoolExecutor(1)
        fs = FollowSet(f_dir, lambda: SECRET, "F", pool, lambda s, w: welcomed.add(s))
        try:
            await fs.set({sa: Scope(True, frozenset({VA, VB}))})
            await _until("A's bulk sync", lambda: fs.synced and read(f"{VB}/q/msgs.1") == b"HEADb1")
            live(a, a_dir, f"{VB}/q/msgs.1", b"b2")
            await _until("A's action on vb", lambda: read(f"{VB}/q/msgs.1") == b"HEADb1b2")

            with pytest.raises(ValueError):
                await fs.set({sa: Scope(True, frozenset({VA, VB})), sb: Scope(False, frozenset({VB}))})
            await fs.set({sa: Scope(True, frozenset({VA})), sb: Scope(False, frozenset({VB}))})
            assert fs.scopes() == {sa: Scope(True, frozenset({VA})), sb: Scope(False, frozenset({VB}))}
            await _until("both bulk syncs", lambda: fs.synced and read(f"{VB}/q/msgs.1") == b"HEADb1B")
            assert welcomed == {sa, sb}
            live(a, a_dir, f"{VB}/q/msgs.1", b"stale")  # A no longer leads vb: not sent to F
            live(a, a_dir, f"{VA}/q/msgs.1", b"a2")
            live(b, b_dir, f"{VB}/q/msgs.1", b"b3")
            await _until("the live actions", lambda: read(f"{VA}/q/msgs.1") == b"HEADa1a2"
                         and read(f"{VB}/q/msgs.1") == b"HEADb1Bb3")
            await _until("F in both ISRs", lambda: a.isr == {"F"} and b.isr == {"F"})
            assert read("users.json") == b'{"users": 1}'
        finally:
            await fs.close()
            await a.stop()
            await b.stop()
            pool.shutdown(wait=True)

    asyncio.run(scenario())


def test_scopes_that_could_share_a_file_overlap() -> None:
    every_but_c = Scope(True, None, frozenset({VC}))
    assert every_but_c.covers("users.json") and every_but_c.covers(f"{VA}/q/m")
    assert not every_but_c.covers(f"{VC}/q/m") and not every_but_c.everything
    cases = [(every_but_c, Scope(False, frozenset({VC})), False),
             (every_but_c, Scope(False, frozenset({VA, VC})), True),
             (every_but_c, Scope(True, frozenset()), True),  # both take the shared files
             (Scope(False, None), Scope(False, None, frozenset({VA})), True),
             (Scope(False, frozenset({VA})), Scope(False, frozenset({VB})), False),
             (Scope(False, frozenset({VA})), Scope(False, frozenset({VA})), True)]
    for x, y, expected in cases:
        assert x.overlaps(y) is expected and y.overlaps(x) is expected, (x, y)


def test_the_plan_follows_each_shard_from_the_node_serving_it() -> None:
    a, b, c = "tcp://10.0.0.1:5679", "tcp://10.0.0.2:5680", "tcp://10.0.0.3:5679"
    sa, sb, sc = Sender("10.0.0.1", 5679), Sender("10.0.0.2", 5680), Sender("10.0.0.3", 5679)
    # nobody but the cluster leader serves: follow it for everything (today's cluster)
    assert follow_plan(b, a, {}) == {sa: EVERYTHING}
    assert follow_plan(a, a, {}) == {}
    served = {VA: a, VB: b, VC: c}  # a: the cluster leader, serving va itself
    assert follow_plan(b, a, served) == {sa: Scope(True, None, frozenset({VB, VC})),
                                         sc: Scope(False, frozenset({VC}))}
    assert follow_plan(a, a, served) == {sb: Scope(False, frozenset({VB})), sc: Scope(False, frozenset({VC}))}
    plan = follow_plan(c, a, served)
    assert plan == {sa: Scope(True, None, frozenset({VB, VC})), sb: Scope(False, frozenset({VB}))}
    scopes = list(plan.values())
    assert not scopes[0].overlaps(scopes[1])
    # c won vb from b, which is gone: c takes vb from nobody (not the cluster leader's copy)
    assert follow_plan(c, a, {VA: a}, paused=frozenset({VB})) == {sa: Scope(True, None, frozenset({VB}))}
    assert follow_plan(c, a, served, paused=frozenset({VB})) == {sa: Scope(True, None, frozenset({VB, VC}))}


def test_a_follower_is_in_the_isr_of_the_shards_it_takes_only(tmp_path: Path) -> None:
    """On the sender: a follower whose scope leaves shard b out is sent none of b's actions, is
    no replica of b, is not named in b's ISR key, and b's confirms do not wait for it."""
    async def scenario() -> None:
        async def publish(members: list[str]) -> bool:
            return True

        sink = ShardedLeaderSink(tmp_path, "L", SECRET, publish, lambda shard, members: publish(members))
        for fid, scope in (("F", EVERYTHING), ("G", Scope(True, frozenset({VA})))):
            f = FollowerConn(fid, "peer", cast(Any, None), scope)
            f.backlog, f.synced = None, True
            sink.followers[fid] = f
        sink.isr = {"F", "G"}
        F, G = sink.followers["F"], sink.followers["G"]
        sink.append(tmp_path / VA / "q" / "seg", b"x" * 10)
        g_sent = G.sent
        sink.append(tmp_path / VB / "q" / "seg", b"y" * 10)
        assert G.sent == g_sent  # b's action not sent to G
        assert sink.shard_members(VB, ["F", "G", "L"]) == ["F", "L"] and sink.shard_isr(VA) == {"F", "G"}
        only_b = sink._barrier_at(sink._positions({VB}))
        sink._on_ack(F, F.sent)
        await asyncio.wait_for(only_b, DEADLINE)  # G never acked: b's confirm did not wait for it
        sink._on_ack(G, G.sent)
        assert sink.shard_replicas(VB) == ["L", "F"] and sink.shard_replicas(VA) == ["L", "F", "G"]

    asyncio.run(scenario())


def test_a_shard_leader_key_names_its_server_only_when_it_says_it_serves() -> None:
    from broker.cluster.etcd import shard_server
    assert shard_server(b'{"node_id": "b", "uri": "tcp://10.0.0.2:5679"}') is None  # leads, not serving yet
    assert shard_server(b'{"node_id": "b", "uri": "tcp://10.0.0.2:5679", "serves": true}') == "tcp://10.0.0.2:5679"
    for junk in (b"not json", b"[1]", b'{"serves": true}', b'{"serves": 1, "uri": "x"}'):
        assert shard_server(junk) is None
