"""Replication scoped by shard on the one stream (issue 27; ``[clustering] shard_leaders``).

Theory of operation
-------------------
The cluster leader still replicates every shard (vhost) down one stream per follower
(``LeaderSink``); this subclass, used only with per-shard leaders on, reads that stream per
shard, so ``LeaderSink`` itself stays call-for-call what it is without the flag.

After each replicated action the shard it belongs to (``files.shard_of``: the vhost's
directory; ``SHARED`` for the node's shared files) is noted: per follower, the stream position
of the shard's last action (``FollowerConn.shard_sent``) and when its oldest unacked one was
sent (``shard_since``); for the sink, the shards written since the last group commit
(``touched``).

The shard's ISR is the cluster's ISR less the members that fell behind on that shard
(``shard_out``). A member whose oldest unacked action of a shard was sent ``SHARD_STALL``
seconds ago (its acks progressing or not) leaves that shard's ISR only: its ISR key
(``<prefix>/shards/<vhost>/isr``) is rewritten without it first (fenced on our leadership:
a failover must not go to a node that lacks the shard's confirmed messages), and only then do
the shard's confirms stop waiting for it. Once it holds the shard again it rejoins: locally
first (confirms wait for it from then on), then in etcd. It stays in every other shard's ISR;
a member with no ack progress at all for ``STALL_TIMEOUT`` still leaves the cluster's ISR, and
so every shard's. A write of the cluster's ISR, and the election pass mending a key, write
each shard's key as the cluster's members less that shard's ``shard_out`` and those on their
way out of it (``shard_members``): no write racing a member's removal puts it back (the mend
also compares the key's value as it read it).

A group commit's barrier (``shard_barrier``, the syncer's ``replicated``) waits, per follower,
for the last position of each shard the commit touched whose ISR names it: a message of vhost
v is confirmed when the members of v's ISR hold it. Shared files touched (users, vhosts,
parameters) take the full barrier: every cluster ISR member holds them. Commits run one at a
time in order, so every action before this barrier was covered by an earlier one.

While one stream carries every shard a follower's acks are one position, so it falls behind
on one shard only while that shard alone has been written since its last ack; shard leaders
each streaming their own shard (``cluster/shard_server.py``, which runs this sink for the
shards a node serves; the hand-over driving it is not built yet) make the split real. A
follower whose connection's scope (``files.Scope``) leaves a shard out takes that shard from
another sender: it is sent none of its actions, holds no replica of it here and is named in
no ISR key of it written from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from broker.cluster.files import is_replicated, relative, shard_of
from broker.cluster.leader import STALL_TIMEOUT, FollowerConn, IsrPublisher, LeaderSink

log = logging.getLogger(__name__)

SHARED = ""  # the "shard" of the node's shared files: every cluster ISR member must hold them
SHARD_STALL = STALL_TIMEOUT  # seconds a shard's oldest unacked action may wait before its ISR is left

# Write one shard's ISR (shard = its vhost's directory); True/False/None as ``IsrPublisher``.
ShardIsrWriter = Callable[[str, list[str]], Awaitable[bool | None]]


class ShardedLeaderSink(LeaderSink):
    """``LeaderSink`` that keeps each shard's positions and ISR off the one stream."""

    def __init__(self, data_dir: Path, node_id: str, secret: bytes, publish_isr: IsrPublisher,
                 write_shard_isr: ShardIsrWriter) -> None:
        super().__init__(data_dir, node_id, secret, publish_isr)
        self.write_shard_isr = write_shard_isr
        self.touched: set[str] = set()  # shards written since the last group commit's barrier
        self.shard_out: dict[str, set[str]] = {}  # shard -> cluster ISR members behind on it
        self._moving: set[tuple[str, str]] = set()  # (shard, follower) with a write under way
        self._leaving: set[tuple[str, str]] = set()  # ... of those, the ones leaving the shard
        self._touched_of: dict[asyncio.Future[None], set[str]] = {}
        self.lost: set[str] = set()  # shards whose term we lost: no confirm of them resolves (``lose``)

    # ------------------------------------------------------------ tagging
    def register_file(self, path: Path) -> None:
        super().register_file(path)
        self._tag(path)

    def append(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        super().append(path, data)
        self._tag(path)

    def replace(self, path: Path, data: bytes) -> None:
        super().replace(path, data)
        self._tag(path)

    def delete(self, path: Path) -> None:
        super().delete(path)
        self._tag(path)

    def _tag(self, path: Path) -> None:
        """Note the action just sent as its shard's last (all sink calls run on the loop)."""
        rel = relative(self.data_dir, path)
        if rel is None or not is_replicated(rel):
            return
        shard = shard_of(rel) or SHARED
        self.touched.add(shard)
        now = time.monotonic()
        for f in self.followers.values():
            if f.backlog is None and (f.everything or f.scope.covers(rel)):
                if f.acked >= f.shard_sent.get(shard, 0):
                    f.shard_since[shard] = now  # its oldest unacked action of the shard
                f.shard_sent[shard] = f.sent

    # ------------------------------------------------------------ ISR per shard
    def shard_isr(self, shard: str) -> set[str]:
        return self.isr - self.shard_out.get(shard, set()) - self._not_taking(shard)

    def shard_members(self, shard: str, members: list[str]) -> list[str]:
        """The cluster ISR ``members`` as this shard's ISR key names them: less those behind on
        it, those on their way out (a write of the key racing theirs must not name them), and
        followers whose scope leaves the shard out (they take it from another sender)."""
        out = self.shard_out.get(shard, set()) | self._not_taking(shard)
        return [m for m in members if m not in out and (shard, m) not in self._leaving]

    def _not_taking(self, shard: str) -> set[str]:
        return {fid for fid, f in self.followers.items() if not f.everything and not f.scope.takes(shard)}

    def shard_replicas(self, shard: str) -> list[str]:
        return [m for m in super().shard_replicas(shard) if m not in self.shard_out.get(shard, set())]

    def _maybe_join(self, f: FollowerConn) -> None:
        joining = f.node_id not in self.isr
        super()._maybe_join(f)
        if joining and f.node_id in self.isr:  # in sync with everything: in every shard's ISR
            for out in self.shard_out.values():
                out.discard(f.node_id)
        if f.node_id not in self.isr or self.fenced or self.followers.get(f.node_id) is not f:
            return
        now = time.monotonic()
        for shard, pos in f.shard_sent.items():
            if shard == SHARED or (shard, f.node_id) in self._moving:
                continue
            out = self.shard_out.setdefault(shard, set())
            if f.node_id in out and f.holds(shard):
                out.discard(f.node_id)  # before the etcd write: confirms wait for it from now on
                self._move(shard, f.node_id, f"{f.node_id} holds it again")
            elif f.node_id not in out and f.acked < pos and now - f.shard_since.get(shard, now) > SHARD_STALL:
                behind = now - f.shard_since[shard]
                self._move(shard, f.node_id, f"{f.node_id} behind on it for {behind:.1f}s", leave=True)

    def _move(self, shard: str, fid: str, why: str, leave: bool = False) -> None:
        self._moving.add((shard, fid))
        if leave:
            self._leaving.add((shard, fid))
        self._spawn(self._write_shard(shard, fid, why, leave))

    async def _write_shard(self, shard: str, fid: str, why: str, leave: bool) -> None:
        try:
            members = sorted(m for m in {self.node_id, *self.shard_isr(shard)} if not (leave and m == fid))
            written = await self.write_shard_isr(shard, members)
            if written is False:
                log.error("could not write shard %s's ISR: not the leader any more", shard)
                self.fence()
            elif written and leave:
                self.shard_out.setdefault(shard, set()).add(fid)  # etcd first: only now may confirms skip it
                self._release(fid, shard)
            if written:
                log.warning("shard %s's ISR is now %s (%s)", shard, members, why)
        finally:
            self._moving.discard((shard, fid))
            self._leaving.discard((shard, fid))
        self._check_barriers()

    # ------------------------------------------------------------ barrier per shard
    def shard_barrier(self) -> asyncio.Future[None]:
        """The group commit's barrier: each follower acks the last action of every shard
        written since the last commit whose ISR names it (shared files: the full barrier)."""
        touched, self.touched = self.touched, set()
        if touched & self.lost:
            return self._failed()  # ``lose``
        if SHARED in touched:
            return self.barrier()
        fut = self._barrier_at(self._positions(touched))
        if not fut.done():
            self._touched_of[fut] = touched
            fut.add_done_callback(self._touched_of.pop)
        return fut

    def _positions(self, touched: set[str]) -> dict[FollowerConn, int]:
        out: dict[FollowerConn, int] = {}
        for fid in self.isr:
            f = self.followers.get(fid)
            if f is None:
                continue
            pos = max((f.shard_sent.get(s, 0) for s in touched if fid not in self.shard_out.get(s, ())),
                      default=0)
            out[f] = max(pos, f.floor) if pos else 0
        return out

    def _release(self, fid: str, shard: str) -> None:
        """``fid`` left ``shard``'s ISR: the pending barriers that waited for it on that shard
        wait only for the other shards they touched (at their current, never lower, positions)."""
        for targets, fut in self._barriers:
            touched = self._touched_of.get(fut)
            f = next((t for t in targets if t.node_id == fid), None)
            if touched is None or f is None or shard not in touched:
                continue
            pos = self._positions(touched).get(f, 0)
            if pos:
                targets[f] = pos
            else:
                del targets[f]

    # ------------------------------------------------------------ a shard lost, the others served
    def lose(self, shard: str) -> None:
        """Our term of ``shard`` is gone (its key resigned or taken) while we still serve others
        (a shard server, ``cluster/shard_server.py``): every barrier touching it, pending or
        new, fails (its next holder may be opening its copy without what we would confirm:
        the commit's publishers are nacked, never confirmed), while every other shard's
        confirms go on. ``fence`` would stop them all; a barrier that never resolved would
        wedge the syncer, whose commits wait for each other."""
        self.lost.add(shard)
        self._check_barriers()

    def _check_barriers(self) -> None:
        if self.lost:
            keep: list[tuple[dict[FollowerConn, int], asyncio.Future[None]]] = []
            for targets, fut in self._barriers:
                if self._touched_of.get(fut, set()) & self.lost:
                    fut.set_exception(RuntimeError("a shard of this commit moved to another node"))
                else:
                    keep.append((targets, fut))
            self._barriers = keep
        super()._check_barriers()

    def _failed(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_exception(RuntimeError("a shard of this commit moved to another node"))
        return fut
