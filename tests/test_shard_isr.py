"""Replication scoped by shard, step one (issue 27): an ISR key per shard,
``<prefix>/shards/<quoted vhost>/isr``, written with the cluster's ISR in one fenced etcd
transaction by the node replicating the shard's data, and read by the per-shard election, which
hands a shard only to a node that key names. No etcd here (tests/integration/test_cluster_shards.py
runs it on a real cluster)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

from broker.cluster.etcd import shard_isr_key, shard_isrs, shard_key, shard_of_key
from broker.cluster.files import shard_name, shard_of
from broker.cluster.leader import FollowerConn, LeaderSink
from broker.cluster.shard_sink import ShardedLeaderSink
from broker.cluster.status import format_status
from broker.shards.leaders import Action, decide, in_sync, preferred, replicated_here
from broker.store.paths import vhost_dir

NODES = {"a": 1, "b": 1, "c": 1}
WARM = {n: {"warm": True} for n in NODES}


def test_isr_keys_sit_beside_leader_keys_and_are_not_taken_for_them() -> None:
    for vhost in ["/", "a/b", "100%"]:
        key = shard_isr_key(vhost)
        assert key == shard_key(vhost).removesuffix("/leader") + "/isr"
        assert shard_of_key(key) is None  # the election's leader-key scan skips it
    keys = {shard_isr_key("a/b"): (json.dumps(["a", "c"]).encode(), 5),
            shard_key("a/b"): (b'{"node_id": "a", "uri": "x"}', 6),
            shard_isr_key("junk"): (b"not json", 7),
            shard_isr_key("odd"): (b'{"a": 1}', 8)}
    assert shard_isrs(keys) == {"a/b": ["a", "c"]}  # unreadable ones: as if absent


def test_a_shard_fails_over_only_to_a_node_its_own_isr_names() -> None:
    vhost = next(v for v in (f"vh{i}" for i in range(100)) if preferred(v, NODES) == "a")
    live = {"b": 1, "c": 1}  # a died
    second = preferred(vhost, live)
    third = "c" if second == "b" else "b"
    # the cluster's ISR names both survivors; the shard's own names only the third one
    assert decide(second, vhost, None, live, in_sync(WARM, ["a", "b", "c"])) is Action.CAMPAIGN
    shard = in_sync(WARM, [third])
    assert decide(second, vhost, None, live, shard) is Action.WAIT
    assert decide(third, vhost, None, live, shard) is Action.CAMPAIGN
    # and a leader its shard's ISR no longer names hands the shard to one it does
    assert decide(second, vhost, second, live, shard) is Action.RESIGN


def test_one_stream_is_acked_per_shard(tmp_path: Path) -> None:
    """Each action is tagged with its shard (its vhost's directory); a follower holds a shard
    once it acked that shard's last action, whatever later actions of other shards it lacks."""
    async def scenario() -> None:
        async def publish(members: list[str]) -> bool:
            return True

        sink = ShardedLeaderSink(tmp_path, "L", b"secret", publish, lambda shard, members: publish(members))
        f = FollowerConn("F", "peer", cast(Any, None))
        f.backlog, f.synced = None, True
        sink.followers["F"], sink.isr = f, {"F"}
        a, b = (vhost_dir(Path(), v).name for v in ("a", "b"))
        assert shard_of(f"{a}/q/segment") == a and shard_of("users.json") is None
        sink.append(tmp_path / a / "q" / "seg", b"x" * 10)
        after_a = f.sent
        sink.append(tmp_path / b / "q" / "seg", b"y" * 10)
        sink.replace(tmp_path / "users.json", b"{}")  # shared: no shard's
        sink._on_ack(f, after_a)
        assert sink.shard_replicas(a) == ["L", "F"] and sink.shard_replicas(b) == ["L"]
        sink._on_ack(f, f.sent)
        assert sink.shard_replicas(b) == ["L", "F"]
        sink.isr.clear()  # out of the ISR: holds nothing for anyone
        assert sink.shard_replicas(a) == ["L"]

    asyncio.run(scenario())


def test_cluster_status_shows_each_shards_isr() -> None:
    status: dict[str, Any] = {
        "etcd": "e", "prefix": "p", "isr": ["a", "b"], "leader": {"node_id": "a", "uri": "tcp://a"},
        "members": [{"node_id": "a", "uri": "tcp://a", "role": "leader", "in_isr": True,
                     "lag_bytes": None, "shards_led": 1}],
        "shards": [{"vhost": "v1", "leader": "a", "isr": ["a", "b"]},
                   {"vhost": "v2", "leader": None, "isr": None}]}
    table = format_status(status).splitlines()
    assert table[-3].split() == ["VHOST", "LEADER", "ISR"]
    assert table[-2].split() == ["v1", "a", "a,", "b"] and table[-1].split() == ["v2", "-", "-"]


def _calls(fn: Any) -> list[str]:
    """The broker's functions ``fn()`` calls, in order (sys.setprofile; the standard library's
    and builtins left out: they differ between Python versions)."""
    import sys

    import broker
    root = str(Path(broker.__file__).parent)
    seen: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_flag_off_replication_makes_the_calls_it_always_made(tmp_path: Path) -> None:
    """Per-shard bookkeeping costs the flag-off hot path nothing: an append reaching two
    followers makes exactly the calls it made before shards existed (no shard lookup, no extra
    method per action)."""
    async def publish(members: list[str]) -> bool:
        return True

    sink = LeaderSink(tmp_path, "L", b"secret", publish)
    for fid in ("F", "G"):
        f = FollowerConn(fid, "peer", cast(Any, None))
        f.backlog, f.synced = None, True
        f.wake = cast(Any, type("Wake", (), {"set": lambda self: None})())
        sink.followers[fid] = f
    a = vhost_dir(Path(), "a").name
    path = tmp_path / a / "q" / "seg"
    sink.append(path, b"warm")
    calls = _calls(lambda: sink.append(path, b"x" * 10))
    assert calls == ["append", "relative", "is_replicated", "append", "encode_append", "_path_bytes",
                     "action", "send", "action", "send"], calls


def test_confirms_wait_for_the_shards_isr_and_a_member_behind_leaves_only_that_shard(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A group commit's barrier waits for each shard it touched at that shard's position, for
    the members of that shard's ISR; a member behind on one shard for SHARD_STALL leaves that
    shard's ISR alone (its etcd key written first), and rejoins once it holds the shard."""
    from broker.cluster import shard_sink
    monkeypatch.setattr(shard_sink, "SHARD_STALL", 0.05)
    writes: list[tuple[str, list[str]]] = []

    async def scenario() -> None:
        async def publish(members: list[str]) -> bool:
            return True

        async def write_shard(shard: str, members: list[str]) -> bool:
            writes.append((shard, members))
            return True

        sink = ShardedLeaderSink(tmp_path, "L", b"secret", publish, write_shard)
        for fid in ("F", "G"):
            f = FollowerConn(fid, "peer", cast(Any, None))
            f.backlog, f.synced = None, True
            sink.followers[fid] = f
        sink.isr = {"F", "G"}
        F, G = sink.followers["F"], sink.followers["G"]
        a, b = (vhost_dir(Path(), v).name for v in ("a", "b"))
        sink.append(tmp_path / a / "q" / "seg", b"x" * 10)
        after_a = G.sent
        sink.append(tmp_path / b / "q" / "seg", b"y" * 10)
        both = sink.shard_barrier()
        sink._on_ack(F, F.sent)
        sink._on_ack(G, after_a)  # G holds a, not b
        assert not both.done()
        await asyncio.sleep(0.1)
        sink._maybe_join(G)  # the watchdog's look: behind on b past SHARD_STALL
        # while b's key is being written without G, no other write of it names G
        assert sink.shard_members(b, ["F", "G", "L"]) == ["F", "L"]
        await asyncio.wait_for(both, 2)
        assert writes == [(b, ["F", "L"])]  # b's ISR key without G; a's untouched
        assert sink.isr == {"F", "G"} and sink.shard_isr(a) == {"F", "G"} and sink.shard_isr(b) == {"F"}
        assert sink.shard_replicas(b) == ["L", "F"]
        # a commit on a alone still waits for G (a's ISR names it)
        sink.append(tmp_path / a / "q" / "seg", b"z" * 10)
        only_a = sink.shard_barrier()
        sink._on_ack(F, F.sent)
        await asyncio.sleep(0)
        assert not only_a.done()
        sink._on_ack(G, G.sent)  # G holds everything again: back in b's ISR
        await asyncio.wait_for(only_a, 2)
        for _ in range(20):
            if len(writes) == 2:
                break
            await asyncio.sleep(0.01)
        assert writes[1] == (b, ["F", "G", "L"]) and sink.shard_isr(b) == {"F", "G"}
        # the cluster's ISR write names each shard's members less those behind on it
        sink.shard_out[b] = {"G"}
        assert sink.shard_members(b, ["F", "G", "L"]) == ["F", "L"]
        assert sink.shard_members(a, ["F", "G", "L"]) == ["F", "G", "L"]

    asyncio.run(scenario())


def test_the_cluster_leader_leaves_a_shard_served_elsewhere_to_its_server() -> None:
    """Step 2: a shard whose leader key says another node serves it is replicated by that node,
    which alone writes its ISR key; the cluster leader writes (and mends) the others' only."""
    vhosts = ["a", "b", "c"]
    me, other = "tcp://l:1", "tcp://o:1"
    assert replicated_here(vhosts, {}, me) == vhosts  # nothing served yet: every shard ours
    serving = {shard_name("b"): other, shard_name("c"): me}
    assert replicated_here(vhosts, serving, me) == ["a", "c"]
