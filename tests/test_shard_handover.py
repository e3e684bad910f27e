"""The hand-over rule of a shard between the nodes serving it (``cluster/handover.py``): each
case is one moment of a move, as a node sees it in etcd and in itself. Pure: the real cluster
runs it in tests/integration/test_cluster_shards.py once the runner drives it."""

from __future__ import annotations

import logging

import pytest

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
