"""The hand-over of a shard between the nodes serving it (step 2 of the per-shard data path).

Theory of operation
-------------------
A shard is served by one node at a time: the cluster leader while no shard leader key says
``"serves": true``, else the node whose key says so. Its election (``shards/leaders.py``) may
give its key to another node while the current server still serves it; serving must then move
without a confirmed message being taken back and without two nodes confirming for it at once.
``step`` is the rule each node applies to each shard on every pass, from what the pass read in
etcd (``Seen``) and what the node knows of itself; the runner carries it out.

* The current server keeps serving while it holds the shard's key (``SERVE``), and closes it,
  fenced, as soon as another node holds it or nobody does (``CLOSE``): no confirm of the shard
  leaves it afterwards. The cluster leader serves, by default, every shard nobody holds.
* A node that closed a shard hands it over once the holder holds the shard's last action
  (its acks on our stream say so): it writes the release naming the holder's term
  (``RELEASE``; ``Etcd.release_shard``, written only while that holder's key stands), again for
  each later holder until one marks the shard served. A node that closed a shard and holds it
  again before anyone marked it opens it again: nothing was confirmed of it meanwhile (a
  holder's clients reach it only by its mark, which it writes only on a key it still holds).
* The holder opens the shard (``OPEN``: its links drop the shard, their last batch written,
  then the broker boots it from its copy, and only then its key says ``serves``) on a release
  for its own term, or when the previous server's key is gone (its lease expired, or it
  resigned: a new holder's key exists only then) and the shard's ISR key names the holder:
  that server's confirms waited for every member of that key, and a write of the key without
  us is fenced on a term that is no longer its own. Our links drop the shard before it opens,
  their last batch written, so every action we acked is in our copy.
* While a shard's previous server (not the cluster leader) is gone and no other node has
  marked it, a node follows it from nobody (``PAUSE``): the cluster leader's copy may be stale,
  and a bulk sync from it would take confirmed messages back. That holds for the server that
  closed it too, until its holder marks it: our copy is the shard's last, the cluster leader's
  is not. A holder that never saw the
  previous server cannot tell it was gone, so it waits for a release (``FOLLOW``).
* Every node but the shard's server follows it from that server, the cluster leader included
  (``runner.py`` ``_follow_served``): the cluster leader is in the ISR of every shard others
  serve, so a failover may come to it (with the other nodes down, it may hold the only copy).
* A server that closed a shard keeps replicating it, read-only, until it has released it
  (``Moves.handing``; ``follow_set.follow_plan``; ``ShardServer.closed``): every other node that
  would follow the shard from nobody follows it from that server instead, so the holder's acks
  reach the shard's last action and the release it waits for comes. The closed copy takes no
  write meanwhile: its broker no longer serves it, and the closing node's own links leave it
  alone (on a node other than the cluster leader, a shard closed here is followed from nobody
  until someone marks it: the cluster leader's copy is older than ours). Without this the two
  sides waited on each other for ever (issue 27's hand-back hang): a holder the shard's ISR key
  does not name (it fell behind on the shard after its campaign read the key) followed it from
  nobody, waiting for the release, while the old server refused a follower naming a shard it
  had closed and released only to a holder holding its last action.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)


class Step(Enum):
    FOLLOW = "follow"  # follow it from its server (or the cluster leader): nothing to do
    SERVE = "serve"  # we serve it and hold its key: go on
    CLOSE = "close"  # we serve it without holding its key: close it, fenced
    RELEASE = "release"  # we closed it and its holder holds its last action: release it to that term
    OPEN = "open"  # we hold it and our copy is its last: open it, then mark it served
    PAUSE = "pause"  # its server is gone and nobody serves it yet: follow it from nobody


@dataclass(frozen=True)
class Seen:
    """One shard as a pass read it in etcd."""

    holder: str | None  # the node id its leader key names (None: no key)
    term: int  # that key's create revision (0: no key)
    server: str | None  # the replication URI its key says serves it (None: no mark)
    isr: list[str] | None  # its ISR key (None: none written)
    released: int | None  # the term it was last released to


def step(me: str, seen: Seen, *, serving_here: bool, closed_here: bool, last_server: str | None,
         cluster_leader: str, holder_has_all: bool, default_server: bool = False) -> Step:
    """What node ``me`` does with one shard this pass. ``serving_here``: our broker serves it;
    ``closed_here``: we served it and closed it since, not released yet; ``last_server``: the
    URI of the last node seen marking it served (None: never seen one, the cluster leader
    served it); ``cluster_leader``: the cluster leader's URI; ``holder_has_all``: the holder's
    acks on our stream cover the shard's last action (only asked once we closed it);
    ``default_server``: we are the cluster leader, which serves every shard nobody else holds."""
    ours = seen.holder == me
    if serving_here:
        return Step.SERVE if ours or (seen.holder is None and default_server) else Step.CLOSE
    server_gone = seen.server is None and last_server not in (None, cluster_leader)
    if closed_here and seen.holder is not None and not ours:
        if seen.released != seen.term and holder_has_all:
            return Step.RELEASE
        return Step.PAUSE if server_gone else Step.FOLLOW  # not from the cluster leader's stale copy
    if ours:
        if seen.released == seen.term or closed_here:  # ours again, nobody marked it since we closed it
            return Step.OPEN
        if server_gone:
            return Step.OPEN if seen.isr is not None and me in seen.isr else Step.PAUSE
        return Step.FOLLOW
    return Step.PAUSE if server_gone else Step.FOLLOW


class Moves:
    """One node's memory of the moves across passes: the shards it closed and has not released
    yet, the last server seen for each shard, the shards it follows from nobody, and those it
    follows from the server that closed them until it releases them."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.closed: set[str] = set()  # vhosts
        self.last_server: dict[str, str] = {}  # vhost -> the URI its key last said served it
        self.paused: set[str] = set()  # vhosts followed from nobody (``follow_set.follow_plan``)
        self.said: dict[str, Step] = {}  # vhost -> the step last logged: a hang shows where each side is
        # vhost -> the URI of the server that closed it and has not released it: followed from
        # there meanwhile (its copy is the shard's last, and its release waits for our acks)
        self.handing: dict[str, str] = {}

    def steps(self, seen: Mapping[str, Seen], cluster_leader: str, serving_here: Callable[[str], bool],
              holder_has_all: Callable[[str, str], bool], default_server: bool) -> list[tuple[str, Step]]:
        """Each shard's step this pass (``step``); the paused set follows them: a shard to open
        or close, or without a server, is paused (on a node other than the cluster leader, one
        closed here too until someone marks it), one followed again is not; a paused shard whose
        server closed it and has not released it is ``handing``."""
        out: list[tuple[str, Step]] = []
        for vhost, s in sorted(seen.items()):
            if s.server is not None:
                self.last_server[vhost] = s.server
                if s.holder != self.me:  # served elsewhere now: nothing of ours left to release
                    self.closed.discard(vhost)
            has_all = vhost in self.closed and s.holder is not None and holder_has_all(vhost, s.holder)
            what = step(self.me, s, serving_here=serving_here(vhost), closed_here=vhost in self.closed,
                        last_server=self.last_server.get(vhost), cluster_leader=cluster_leader,
                        holder_has_all=has_all, default_server=default_server)
            if what in (Step.PAUSE, Step.OPEN, Step.CLOSE) or (vhost in self.closed and not default_server):
                self.paused.add(vhost)  # a copy we close is the shard's last: no link of ours writes it
            elif what is Step.FOLLOW:
                self.paused.discard(vhost)
            last = self.last_server.get(vhost)
            if what is Step.PAUSE and vhost not in self.closed and s.server is None and s.holder is not None \
                    and s.released != s.term and last is not None and last != cluster_leader:
                self.handing[vhost] = last  # its closing server releases once its holder holds it all
            else:
                self.handing.pop(vhost, None)
            out.append((vhost, what))
            if self.said.get(vhost) is not what:
                self.said[vhost] = what
                log.info("shard %r: step %s (holder %s term %d, server %s, ISR %s, released to %s; "
                         "closed here %s, last server %s, holder has all %s)", vhost, what.value, s.holder,
                         s.term, s.server, s.isr, s.released, vhost in self.closed,
                         self.last_server.get(vhost), has_all)
        for gone in self.paused - set(seen):
            self.paused.discard(gone)
        for gone in set(self.said) - set(seen):
            del self.said[gone]
        for gone in set(self.handing) - set(seen):
            del self.handing[gone]
        return out
