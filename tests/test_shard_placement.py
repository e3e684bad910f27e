"""The shard map (broker/shards/placement.py): stable, balanced, minimal movement, weighted."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.shards.placement import ShardId, owner, place, score, vhost_shard, worker_of

NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


def test_pinned_placement() -> None:
    # pinned literally: a change of hash or key layout would move the vhosts (and their data
    # directories) of every node on upgrade
    assert [worker_of(f"v{i}", 2) for i in range(8)] == [1, 1, 1, 1, 0, 1, 1, 1]
    assert [worker_of(f"v{i}", 4) for i in range(8)] == [1, 1, 1, 2, 0, 3, 1, 3]
    assert score(0, ShardId("/")) == score(0, ShardId("/"))


def test_one_worker_owns_everything() -> None:
    assert {worker_of(f"v{i}", 1) for i in range(50)} == {0}


@settings(max_examples=50, deadline=None)
@given(st.lists(NAMES, min_size=1, max_size=20, unique=True), st.integers(2, 8))
def test_owner_is_a_member_and_deterministic(vhosts: list[str], n: int) -> None:
    for v in vhosts:
        w = worker_of(v, n)
        assert 0 <= w < n
        assert w == worker_of(v, n)


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 8), st.integers(0, 1 << 30))
def test_balanced(n: int, salt: int) -> None:
    shards = [ShardId(f"{salt}-{i}") for i in range(400 * n)]
    counts = Counter(place(shards, range(n)).values())
    # 400 shards per member expected; binomial sd ~ 20: 25 % slack is > 5 sd
    assert min(counts.values()) > 300 and max(counts.values()) < 500, counts


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 7), st.integers(0, 1 << 30))
def test_adding_a_member_moves_only_shards_to_it(n: int, salt: int) -> None:
    shards = [ShardId(f"{salt}-{i}") for i in range(500)]
    before = place(shards, range(n))
    after = place(shards, range(n + 1))
    moved = [s for s in shards if before[s] != after[s]]
    assert all(after[s] == n for s in moved)  # only to the new member
    assert len(moved) < 2 * len(shards) / (n + 1)  # about 1/(n+1) of them


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 8), st.integers(0, 1 << 30), st.data())
def test_removing_a_member_moves_only_its_shards(n: int, salt: int, data: st.DataObject) -> None:
    gone = data.draw(st.integers(0, n - 1))
    shards = [ShardId(f"{salt}-{i}") for i in range(300)]
    before = place(shards, range(n))
    after = place(shards, [m for m in range(n) if m != gone])
    assert all(before[s] == after[s] for s in shards if before[s] != gone)


def test_weights() -> None:
    shards = [ShardId(f"w{i}") for i in range(3000)]
    counts = Counter(place(shards, {0: 1.0, 1: 2.0, 2: 1.0}).values())
    assert 1300 < counts[1] < 1700  # half of them
    assert 600 < counts[0] < 900 and 600 < counts[2] < 900
    assert owner(ShardId("x"), {0: 0.0, 1: 1.0}) == 1
    with pytest.raises(ValueError):
        owner(ShardId("x"), {0: 0.0})


def test_node_worker_members_and_finer_shards() -> None:
    members = [("node-a", 0), ("node-a", 1), ("node-b", 0)]
    counts = Counter(place([ShardId("s", str(i)) for i in range(900)], members).values())
    assert set(counts) == set(members) and min(counts.values()) > 200
    assert vhost_shard("v") == ShardId("v", "")
    assert ShardId("v", "1") != ShardId("v1", "")  # the separator keeps parts apart
