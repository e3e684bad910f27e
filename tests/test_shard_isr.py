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
from broker.cluster.files import shard_of
from broker.cluster.leader import FollowerConn, LeaderSink
from broker.cluster.status import format_status
from broker.shards.leaders import Action, decide, in_sync, preferred
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

        sink = LeaderSink(tmp_path, "L", b"secret", publish)
        sink.by_shard = True
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
