"""Per-shard leadership's decisions (broker/shards/leaders.py), with no etcd and no sockets."""

from __future__ import annotations

from collections import Counter

from broker.cluster.etcd import shard_holder, shard_key, shard_of_key
from broker.cluster.status import ClusterView
from broker.shards.leaders import Action, decide, in_sync, live_nodes
from broker.shards.placement import node_of, vhost_shard

NODES = {"a": 1, "b": 1, "c": 1}
VHOSTS = [f"vh{i}" for i in range(300)]


def leaders(live: dict[str, int], isr: set[str] | None = None) -> dict[str, str]:
    """Who campaigns for each shard when nobody leads it: exactly one node per shard."""
    out = {}
    for vhost in VHOSTS:
        campaigners = [n for n in live if decide(n, vhost, None, live, isr) is Action.CAMPAIGN]
        assert len(campaigners) == 1, (vhost, campaigners)
        out[vhost] = campaigners[0]
    return out


def test_each_shard_has_one_campaigner_and_the_nodes_share_them() -> None:
    placed = leaders(NODES)
    counts = Counter(placed.values())
    assert set(counts) == {"a", "b", "c"}
    assert all(80 <= n <= 120 for n in counts.values()), counts  # about a third each


def test_a_node_leaving_moves_only_its_shards_and_returning_hands_them_back() -> None:
    before = leaders(NODES)
    after = leaders({"a": 1, "b": 1})  # c's lease expired
    assert {v for v in VHOSTS if before[v] != after[v]} == {v for v in VHOSTS if before[v] == "c"}
    # c is back and in sync: whoever stood in for it resigns each of its shards
    for vhost in VHOSTS:
        if before[vhost] == "c":
            assert decide(after[vhost], vhost, after[vhost], NODES, {"a", "b", "c"}) is Action.RESIGN
            assert decide("c", vhost, None, NODES, {"a", "b", "c"}) is Action.CAMPAIGN
        else:
            assert decide(before[vhost], vhost, before[vhost], NODES, {"a", "b", "c"}) is Action.KEEP


def test_a_node_not_in_sync_neither_campaigns_nor_gets_shards_handed_back() -> None:
    isr = {"a", "b"}  # c is live again but still syncing
    two = leaders({"a": 1, "b": 1})
    assert leaders(NODES, isr) == two
    for vhost in VHOSTS:
        holder = two[vhost]
        assert decide(holder, vhost, holder, NODES, isr) is Action.KEEP
        assert decide("c", vhost, None, NODES, isr) is Action.WAIT


def test_a_shard_led_by_another_node_is_left_alone() -> None:
    assert decide("a", "vh0", "b", NODES, None) is Action.WAIT
    assert decide("a", "vh0", "?", NODES, None) is Action.WAIT


def test_weights_are_worker_counts() -> None:
    counts = Counter(node_of(vhost_shard(v), {"a": 2, "b": 1}) for v in VHOSTS)
    assert 170 <= counts["a"] <= 230, counts


def test_shard_keys_round_trip_any_vhost_name() -> None:
    for vhost in ["/", "a/b", "100%", "ä x"]:
        key = shard_key(vhost)
        assert key.startswith("shards/") and key.count("/") == 2
        assert shard_of_key(key) == vhost
    assert shard_of_key("members/x") is None
    assert shard_holder(b'{"node_id": "n1", "uri": "tcp://x"}') == "n1"
    assert shard_holder(b"junk") == "?"


def test_with_the_switch_off_the_member_record_and_status_are_unchanged() -> None:
    view = ClusterView("n1", "tcp://127.0.0.1:1")
    assert view.member_record() == {"uri": "tcp://127.0.0.1:1", "role": "starting", "warm": False}
    assert "shards" not in view.status()
    view.weight, view.shards = 2, {"/": {"leader": "n1", "term": 7, "preferred": "n1"}}
    assert view.member_record()["workers"] == 2
    assert view.status()["shards"] == [{"vhost": "/", "leader": "n1", "term": 7, "preferred": "n1"}]


def test_a_node_restarted_before_the_isr_dropped_it_is_not_in_sync_until_warm() -> None:
    members = {"a": {"warm": True}, "b": {"warm": True}, "c": {"warm": False}}  # c: just restarted
    assert in_sync(members, ["a", "b", "c"]) == {"a", "b"}  # the ISR still names it: not enough
    assert in_sync(members, None) == {"a", "b"}
    members["c"]["warm"] = True  # synced
    assert in_sync(members, ["a", "b", "c"]) == {"a", "b", "c"}
    assert in_sync(members, ["a", "b"]) == {"a", "b"}


def test_a_draining_node_gets_no_shards_and_says_so_in_its_record() -> None:
    view = ClusterView("c", "tcp://c:5679")
    view.weight = 1
    view.warm = True
    view.draining = True
    members = {"a": {"workers": 1, "warm": True}, "b": {"workers": 1, "warm": True},
               "c": view.member_record()}
    assert members["c"]["draining"] is True
    live = live_nodes(members)
    assert live == {"a": 1, "b": 1}
    before = leaders(NODES)
    after = leaders(live)  # c's shards, which it has just resigned, go to the others at once
    assert {v for v in VHOSTS if before[v] != after[v]} == {v for v in VHOSTS if before[v] == "c"}


def test_a_holder_out_of_its_isr_keeps_its_own_shard_while_catching_up() -> None:
    # a new cluster leader writes each ISR key as itself alone; the other follower, the
    # preferred node of the shards it holds, keeps them while it catches up (on main it
    # resigned them at once and won them back after its sync: every one moved twice)
    isr = {"b"}  # b just became the cluster leader; c is syncing from it
    placed = leaders(NODES)
    for vhost in VHOSTS:
        if placed[vhost] != "c":
            continue
        assert decide("c", vhost, "c", NODES, isr, patient=True) is Action.KEEP
        assert decide("c", vhost, "c", NODES, isr) is Action.RESIGN  # past BEHIND_GRACE: stuck
        assert decide("b", vhost, "c", NODES, isr) is Action.WAIT  # nobody else campaigns meanwhile
    # a stand-in out of the ISR hands a shard to its preferred node, patient or not
    stand_in = leaders({"a": 1, "b": 1})
    for vhost in VHOSTS:
        if placed[vhost] == "c":
            holder = stand_in[vhost]
            assert decide(holder, vhost, holder, NODES, {"c"}, patient=True) is Action.RESIGN
