"""The hand-over rule of a shard between the nodes serving it (``cluster/handover.py``): each
case is one moment of a move, as a node sees it in etcd and in itself. Pure: the real cluster
runs it in tests/integration/test_cluster_shards.py once the runner drives it."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from broker.cluster.files import Scope, shard_name
from broker.cluster.follow_set import Sender, follow_plan, sender_of
from broker.cluster.handover import Moves, Seen, Step, step

LEADER = "tcp://a:1"  # the cluster leader, node "a"
B, C = "tcp://b:1", "tcp://c:1"


def _step(me: str, seen: Seen, *, serving_here: bool = False, closed_here: bool = False,
          last_server: str | None = None, holder_has_all: bool = False) -> Step:
    return step(me, seen, serving_here=serving_here, closed_here=closed_here, last_server=last_server,
                cluster_leader=LEADER, holder_has_all=holder_has_all)


def test_from_the_cluster_leader_the_holder_opens_only_on_a_release_for_its_own_term() -> None:
    won = Seen(holder="b", term=7, server=None, isr=["a", "b", "c"], released=None)
    # the cluster leader still serves it: it closes, fenced; the holder keeps following it
    assert _step("a", won, serving_here=True) is Step.CLOSE
    assert _step("b", won) is Step.FOLLOW  # in the ISR, yet the leader may still confirm
    assert _step("c", won) is Step.FOLLOW
    # closed: released only once the holder holds the shard's last action
    assert _step("a", won, closed_here=True) is Step.FOLLOW
    assert _step("a", won, closed_here=True, holder_has_all=True) is Step.RELEASE
    released = Seen(holder="b", term=7, server=None, isr=["a", "b", "c"], released=7)
    assert _step("a", released, closed_here=True, holder_has_all=True) is Step.FOLLOW  # once
    assert _step("b", released) is Step.OPEN
    # the cluster leader holds it again before anyone marked it: it serves it again
    assert _step("a", Seen("a", 8, None, ["a", "b", "c"], 7), closed_here=True) is Step.OPEN
    assert _step("a", Seen("a", 8, None, ["a", "b", "c"], 7)) is Step.FOLLOW  # one it never served
    # a release to an earlier term opens nothing for a later holder
    stale = Seen(holder="b", term=9, server=None, isr=["b"], released=7)
    assert _step("b", stale) is Step.FOLLOW
    # marked: the holder serves it, the others follow it from there
    marked = Seen(holder="b", term=7, server=B, isr=["b", "c"], released=7)
    assert _step("b", marked, serving_here=True, last_server=B) is Step.SERVE
    assert _step("c", marked, last_server=B) is Step.FOLLOW


def test_a_server_killed_its_shard_opens_on_a_holder_its_isr_names_and_nobody_syncs_it_meanwhile() -> None:
    gone = Seen(holder=None, term=0, server=None, isr=["b", "c"], released=7)
    # nobody holds it yet: every node follows it from nobody (the cluster leader's copy is stale)
    assert _step("c", gone, last_server=B) is Step.PAUSE
    assert _step("a", gone, last_server=B) is Step.PAUSE
    won = Seen(holder="c", term=12, server=None, isr=["b", "c"], released=7)
    assert _step("c", won, last_server=B) is Step.OPEN  # named by the key its server kept
    assert _step("a", won, last_server=B) is Step.PAUSE
    # a holder the ISR key does not name waits (the election hands it none, but a stale read may)
    assert _step("a", Seen("a", 13, None, ["b", "c"], 7), last_server=B) is Step.PAUSE
    # a holder that never saw the server cannot tell it is gone: it waits for a release
    assert _step("c", won) is Step.FOLLOW


def test_a_server_that_loses_its_key_closes_at_once_and_releases_to_the_next_holder() -> None:
    assert _step("b", Seen(None, 0, None, ["b", "c"], 7), serving_here=True) is Step.CLOSE
    back = Seen(holder="a", term=20, server=None, isr=["a", "b", "c"], released=7)
    assert _step("b", back, serving_here=True, last_server=B) is Step.CLOSE
    assert _step("b", back, closed_here=True, last_server=B, holder_has_all=True) is Step.RELEASE
    # its server's key is gone (a new holder's key exists only then): whatever it confirmed
    # waited for every member its ISR key names, and a write of that key without us is fenced
    # on a term that is no longer its own, so a holder the key names opens from its own copy
    assert _step("a", back, last_server=B) is Step.OPEN
    assert _step("c", back, last_server=B) is Step.PAUSE  # until the holder marks it
    assert _step("c", Seen("a", 20, LEADER, ["a", "b", "c"], 20), last_server=LEADER) is Step.FOLLOW


def test_a_server_that_closed_its_shard_follows_it_from_nobody_until_its_holder_marks_it() -> None:
    """The killed node's return: "c" served the shard while "b" was away; "b" is back, in its
    ISR, and holds it (not marked yet). "c" closed it; until "b" marks it, "c" must not follow it
    from the cluster leader, whose copy is older than ours (on main: FOLLOW, and a bulk sync
    from the cluster leader deleted the queue "c" had confirmed)."""
    back = Seen(holder="b", term=30, server=None, isr=["b", "c"], released=7)
    assert _step("c", back, closed_here=True, last_server=C) is Step.PAUSE
    assert _step("c", back, closed_here=True, last_server=C, holder_has_all=True) is Step.RELEASE
    # the cluster leader that closed a shard it served keeps its own copy: nothing to pause
    held = Seen("b", 7, None, ["a", "b"], None)
    assert _step("a", held, closed_here=True, last_server=LEADER) is Step.FOLLOW
    marked = Seen(holder="b", term=30, server=B, isr=["b", "c"], released=30)
    assert _step("c", marked, last_server=B) is Step.FOLLOW


def test_each_shard_step_is_logged_when_it_changes_only(caplog: pytest.LogCaptureFixture) -> None:
    """A hang shows which step each side is in: a pass logs a shard's step only when it differs
    from the one last logged for that shard (passes run four times a second)."""
    moves = Moves("b")
    won = {"v": Seen(holder="b", term=7, server=None, isr=["a", "b"], released=None)}
    opened = {"v": Seen(holder="b", term=7, server=None, isr=["a", "b"], released=7)}
    with caplog.at_level(logging.INFO, logger="broker.cluster.handover"):
        for seen in (won, won, won, opened, opened):
            moves.steps(seen, LEADER, lambda v: False, lambda v, h: False, False)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("shard 'v': step follow (holder b term 7") and "released to None" in said[0]
    assert said[1].startswith("shard 'v': step open") and "released to 7" in said[1]


def _plan(uri: str, moves: Moves, seen: dict[str, Seen]) -> dict[Sender, Scope]:
    """Whom a follower's loop follows for what after a pass (``runner._follow_shards``)."""
    serving = {shard_name(v): s.server for v, s in seen.items() if s.server is not None}
    return follow_plan(uri, LEADER, serving, frozenset(shard_name(v) for v in moves.paused),
                       {shard_name(v): u for v, u in moves.handing.items()})


def _from(plan: dict[Sender, Scope], uri: str, vhost: str) -> bool:
    scope = plan.get(sender_of(uri))
    return scope is not None and scope.takes(shard_name(vhost))


def test_a_closed_shard_is_handed_back_to_a_holder_behind_on_its_last_action() -> None:
    """Issue 27's hand-back hang, pass by pass. "c" served the shard (marked) while "b" was
    away; "b" is back, follows it from "c", and wins its key, but the ISR key "c" wrote meanwhile
    no longer names it ("b" fell behind on the shard after its campaign read the key), so "b"
    may open only on a release. "c" closes the shard, fenced, and releases only once "b" holds
    its last action. On main "b" followed the shard from nobody once the mark went (and "c"
    refused a follower naming a shard it closed): neither side moved again. Now "c" replicates
    the closed shard, read-only, until it has released it, and "b" follows it from "c"
    meanwhile: released, then opened, then marked; never served by two nodes at once, and the
    closed copy written by nobody (no client, no link of "c")."""
    b, c = Moves("b"), Moves("c")
    serves = {"b": set[str](), "c": {"v"}}
    seen = {"v": Seen(holder="c", term=20, server=C, isr=["b", "c"], released=7)}
    behind = False
    said: list[tuple[str, Step]] = []
    for n in range(12):
        if n == 1:  # "b" won its key; the ISR key "c" wrote meanwhile names only itself
            seen = {"v": Seen(holder="b", term=30, server=None, isr=["c"], released=7)}
            behind = True  # "b" lacks the shard's last action
        # "c" hands over only a copy it still replicates: it releases to a holder holding its last action
        plan_b = _plan(B, b, seen)
        b_follows_c = _from(plan_b, C, "v") and ("v" in serves["c"] or "v" in c.closed)
        if b_follows_c:
            behind = False
        has_all = b_follows_c and not behind
        for vhost, what in c.steps(seen, LEADER, serves["c"].__contains__,
                                   lambda v, h, has_all=has_all: h == "b" and has_all, False):
            said.append(("c", what))
            if what is Step.CLOSE:
                serves["c"].discard(vhost)
                c.closed.add(vhost)
            elif what is Step.RELEASE:
                seen[vhost] = dataclasses.replace(seen[vhost], released=seen[vhost].term)
        assert not any(_from(_plan(C, c, seen), u, "v") for u in (LEADER, B)) or "v" not in c.closed, \
            "the closed copy is written by no link of its server"
        for vhost, what in b.steps(seen, LEADER, serves["b"].__contains__, lambda v, h: False, False):
            said.append(("b", what))
            if what is Step.OPEN:
                assert not _from(_plan(B, b, seen), C, vhost), "the links drop it before it opens"
                assert not behind, "the holder holds every confirmed action before it serves"
                serves["b"].add(vhost)
                seen[vhost] = dataclasses.replace(seen[vhost], server=B)
        assert not (serves["b"] & serves["c"]), "two servers at once"
        if "v" in serves["b"] and seen["v"].server == B:
            break
    assert "v" in serves["b"] and seen["v"].server == B, f"the hand-back hung: {said}"
    assert said.index(("c", Step.RELEASE)) < said.index(("b", Step.OPEN))
    c.steps(seen, LEADER, serves["c"].__contains__, lambda v, h: False, False)
    assert "v" not in c.closed and "v" not in c.paused and _from(_plan(C, c, seen), B, "v")


def test_a_shard_handed_over_is_followed_from_its_closing_server_not_the_cluster_leader() -> None:
    """The plan for a shard whose server closed it and has not released it: from that server
    (its copy is the last), even while paused, and out of the cluster leader's scope."""
    shard = shard_name("v")
    plan = follow_plan(B, LEADER, {}, frozenset({shard}), {shard: C})
    assert plan[sender_of(C)] == Scope(False, frozenset({shard}))
    assert not plan[sender_of(LEADER)].takes(shard)
    closing = follow_plan(C, LEADER, {}, frozenset({shard}), {shard: C})  # the closing server itself
    assert list(closing) == [sender_of(LEADER)] and not closing[sender_of(LEADER)].takes(shard)
