"""Which files of the data directory are replicated, and their names on the wire.

Everything under the data directory is replicated except node-local files: the
node id, its last cluster role, the data-dir lock, the scratch directory of transient queues,
temporary files of an atomic write in progress and a deleted queue's tombstone (its files were
reported deleted before the rename, and the segment worker removes it: ``store/segment_log``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from broker.store.paths import TOMBSTONE_INSIDE, TOMBSTONE_SUFFIX, vhost_dir

NODE_ID_FILE = ".node_id"
ROLE_FILE = ".cluster_role"  # our role in the last term (see standing.py): about this node only
_LOCAL_NAMES = frozenset({NODE_ID_FILE, ROLE_FILE, ".lock"})
_LOCAL_DIRS = frozenset({"transient"})


def is_replicated(rel: str) -> bool:
    # (``paths.in_tombstone`` inlined: this runs per replicated append)
    parts = rel.split("/")
    return not (parts[0] in _LOCAL_DIRS or parts[-1] in _LOCAL_NAMES or parts[-1].endswith(".tmp")
                or rel.endswith(TOMBSTONE_SUFFIX) or TOMBSTONE_INSIDE in rel)


def relative(data_dir: Path, path: Path) -> str | None:
    """``path`` relative to ``data_dir`` as a POSIX string, or None if outside it."""
    try:
        return path.relative_to(data_dir).as_posix()
    except ValueError:
        return None


def shard_of(rel: str) -> str | None:
    """The shard a replicated path belongs to: its vhost's directory (``<sha1(vhost)>``, where the
    store keeps everything of one vhost); None for the node's shared files (users, vhosts,
    global parameters) and anything else outside a vhost directory."""
    head, sep, _rest = rel.partition("/")
    if sep and len(head) == 40 and all(c in "0123456789abcdef" for c in head):
        return head
    return None


def shard_name(vhost: str) -> str:
    """A vhost's shard as ``shard_of`` names it: its directory's name."""
    return vhost_dir(Path(), vhost).name


@dataclass(frozen=True)
class Scope:
    """What one replication connection carries (issue 27: a follower follows the leader of each
    shard for that shard alone): the node's shared files (users, vhosts, global parameters: the
    cluster leader's) or not, and the named shards (vhost directory names), or with ``shards``
    None every shard but the ``excluded`` ones (those led elsewhere: a vhost created later is
    covered without a new scope). A follower names it; the sender's bulk sync and stream stay
    inside it, and the follower refuses, and never deletes, a path outside it."""

    shared: bool = True
    shards: frozenset[str] | None = None
    excluded: frozenset[str] = frozenset()  # with ``shards`` None only

    @property
    def everything(self) -> bool:
        return self.shared and self.shards is None and not self.excluded

    def covers(self, rel: str) -> bool:
        return self.takes(shard_of(rel))

    def takes(self, shard: str | None) -> bool:
        """Whether the shard (a vhost directory; None: the shared files) is inside."""
        if shard is None:
            return self.shared
        return shard not in self.excluded if self.shards is None else shard in self.shards

    def overlaps(self, other: Scope) -> bool:
        """Whether a file could be inside both (two senders must never write one file)."""
        if self.shared and other.shared:
            return True
        if self.shards is None and other.shards is None:
            return True  # each covers every shard but finitely many
        if self.shards is None:
            assert other.shards is not None
            return bool(other.shards - self.excluded)
        if other.shards is None:
            return bool(self.shards - other.excluded)
        return bool(self.shards & other.shards)


EVERYTHING = Scope()
