"""The shard map: which worker owns a shard, by weighted rendezvous hashing.

Theory of operation
-------------------
A *shard* is the unit of ownership: today a vhost (AMQP never routes across vhosts, so a
vhost with its exchanges, queues, bindings, policies and segment files is self-contained).
``ShardId`` keeps the vhost name and an optional finer part (a super stream's partition,
later) so the front ends, which only ask "who owns the shard of this vhost", need not change
when shards get finer.

Placement is highest random weight (rendezvous) hashing: every member (a worker id today,
``(node, worker)`` later: any hashable name rendered to bytes by ``member_key``) scores every
shard with a hash of (member, shard); the shard goes to the member with the highest score.
Anyone who knows the members computes the same map with no coordination, and when a member
joins or leaves only the shards it wins or held move (about 1/N of them), never the others.

Weights (Schindelhauer and Schomaker's logarithmic method): a member of weight ``w`` scores
``-w / ln(h)`` where ``h`` is the hash mapped into (0, 1); a member of twice the weight owns
about twice the shards, and a weight change moves only shards to or from that member.

The hash is BLAKE2b (8 bytes), keyed by nothing: stable across processes, Python versions
and machines (unlike ``hash()``, which is salted per process).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_SCALE = float(1 << 64)
_SEP = b"\x00"  # between the parts of a hashed key: names cannot contain NUL (auth/names.py)


@dataclass(frozen=True, order=True)
class ShardId:
    """A shard: a vhost, or (later) a finer part of one."""

    vhost: str
    part: str = ""

    def key(self) -> bytes:
        return self.vhost.encode() + _SEP + self.part.encode()


Member = int | str | tuple[str, int]  # a worker index today; (node, worker) in a cluster later


def member_key(member: Member) -> bytes:
    if isinstance(member, tuple):
        return b"n" + member[0].encode() + _SEP + str(member[1]).encode()
    return b"w" + str(member).encode()


def score(member: Member, shard: ShardId, weight: float = 1.0) -> float:
    """The member's weighted random score for the shard (higher wins)."""
    digest = hashlib.blake2b(member_key(member) + _SEP + shard.key(), digest_size=8).digest()
    # (0, 1): never 0 (log(0)) nor 1 (log(1) = 0)
    h = (int.from_bytes(digest, "big") + 0.5) / _SCALE
    return -weight / math.log(h)


def owner(shard: ShardId, members: Iterable[Member] | Mapping[Member, float]) -> Member:
    """The member that owns ``shard`` (``members`` a list, or a map of member -> weight).
    Ties (astronomically rare) go to the smallest member key, so every caller agrees."""
    weights = members if isinstance(members, Mapping) else dict.fromkeys(members, 1.0)
    best: Member | None = None
    best_score = -1.0
    for m, w in weights.items():
        if w <= 0:
            continue
        s = score(m, shard, w)
        if best is None or s > best_score or (s == best_score and member_key(m) < member_key(best)):
            best, best_score = m, s
    if best is None:
        raise ValueError("no member with a positive weight to place a shard on")
    return best


def place(shards: Iterable[ShardId],
          members: Iterable[Member] | Mapping[Member, float]) -> dict[ShardId, Member]:
    """The whole map: each shard to its owner."""
    weights = members if isinstance(members, Mapping) else dict.fromkeys(members, 1.0)
    return {s: owner(s, weights) for s in shards}


def vhost_shard(vhost: str) -> ShardId:
    """The shard of a vhost as a whole (the only grain today)."""
    return ShardId(vhost)


def worker_of(vhost: str, workers: int) -> int:
    """The worker (0 .. workers-1) of a node that owns ``vhost``."""
    if workers <= 1:
        return 0
    found = owner(vhost_shard(vhost), range(workers))
    assert isinstance(found, int)
    return found


def node_of(shard: ShardId, nodes: Mapping[str, int]) -> str:
    """The node (of ``nodes``: node id -> its worker count) whose worker wins ``shard``.

    Placement runs over every ``(node, worker)`` pair, so a node with twice the workers leads
    about twice the shards, and the worker inside the node is the same ``owner`` call away."""
    pairs: list[Member] = [(n, w) for n, count in nodes.items() for w in range(max(1, count))]
    found = owner(shard, pairs)
    assert isinstance(found, tuple)
    return found[0]
