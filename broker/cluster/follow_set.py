"""Following several senders into one data directory (issue 27, the per-shard data path).

Theory of operation
-------------------
With a leader per shard, a node holds copies of shards led elsewhere, and each shard's
events come from its own leader: the cluster leader sends the node's shared files (users,
vhosts, global parameters) and the shards it leads, every other shard leader the shards it
leads. ``FollowSet`` keeps one replication connection (``follower.follow``) per sender, each
asking for its ``Scope``, so a sender's bulk sync and stream stay inside the shards it leads
and the follower refuses (and never deletes) anything outside them.

Two senders must never write one file of ours, so the scopes asked for at once are disjoint
(``set`` refuses overlapping ones), and when a shard moves from one sender to another the
connection that loses it ends first: ``set`` cancels every link whose scope changed or that
went, waits until the one apply worker has finished the batch it was writing (every link
applies on the same single-worker executor, in arrival order), and only then opens the links
that gain a shard. A moved shard is then compared file by file with its new leader (the bulk
sync of a connection is the compare of its scope: only what differs travels).

A link that ends (its sender restarts, the network fails) is reported to ``on_end`` (with
the error, None for a clean close) and opened again after ``RETRY`` seconds with the same
scope until ``set`` changes it or ``close`` ends it. ``synced`` says whether every link
completed its bulk sync since it was (re)opened: the node holds every shard it follows, and
``on_synced`` runs each time that becomes true. Each sender's ``Welcome`` (its client ports) is
handed to ``on_welcome``: where the router sends a client of a shard that sender serves.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from urllib.parse import urlsplit

from broker.cluster import codec, follower
from broker.cluster.files import Scope

log = logging.getLogger(__name__)

RETRY = 0.5  # seconds before a link that ended is opened again


@dataclass(frozen=True)
class Sender:
    """A node's replication port."""

    host: str
    port: int


def sender_of(uri: str) -> Sender:
    """A node's advertised replication URI (``tcp://host:port``) as a ``Sender``."""
    parts = urlsplit(uri)
    return Sender(parts.hostname or "127.0.0.1", parts.port or 5679)


def follow_plan(me: str, cluster_leader: str, serving: Mapping[str, str],
                paused: frozenset[str] = frozenset(),
                handing: Mapping[str, str] = MappingProxyType({})) -> dict[Sender, Scope]:
    """Whom a node follows for what. ``me`` and ``cluster_leader`` are replication URIs;
    ``serving`` maps a shard (its vhost directory) to the URI of the node serving it, for the
    shards a node other than the cluster leader serves. The cluster leader sends the shared files
    and every shard but those; each other node the shards it serves; nobody the shards we serve,
    nor the ``paused`` ones (a shard we won from a server that is gone: our copy holds its
    confirmed messages, a bulk sync from anyone else's could take some back). ``handing`` maps a
    shard whose server closed it and has not released it yet to that server: followed from it,
    paused or not (its copy is the shard's last, and its release waits for our acks:
    ``handover.py``). ``me`` may be the cluster leader: it follows the shards others serve."""
    serving = {**serving, **handing}
    paused = paused - handing.keys()
    away = frozenset(shard for shard, uri in serving.items() if uri != cluster_leader) | paused
    plan: dict[Sender, Scope] = {}
    if cluster_leader != me:
        plan[sender_of(cluster_leader)] = Scope(True, None, away)
    by_node: dict[str, set[str]] = {}
    for shard, uri in serving.items():
        if uri not in (cluster_leader, me) and shard not in paused:
            by_node.setdefault(uri, set()).add(shard)
    for uri, shards in sorted(by_node.items()):
        plan[sender_of(uri)] = Scope(False, frozenset(shards))
    return plan


class _Link:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.synced = False
        self.task: asyncio.Task[None] | None = None


class FollowSet:
    def __init__(self, data_dir: Path, secret: Callable[[], bytes], node_id: str, executor: Executor,
                 on_welcome: Callable[[Sender, codec.Welcome], None] = lambda s, w: None,
                 source_ip: str | None = None,
                 tls: Callable[[], ssl.SSLContext | None] = lambda: None,
                 on_synced: Callable[[], None] = lambda: None,
                 on_end: Callable[[Sender, Exception | None], None] = lambda s, e: None,
                 errors: dict[Sender, str] | None = None, reported: frozenset[Sender] = frozenset()) -> None:
        self.data_dir = data_dir
        self.secret = secret
        self.node_id = node_id
        self.executor = executor  # ONE worker: every link applies on it, in order
        self.on_welcome = on_welcome
        self.source_ip = source_ip
        self.tls = tls
        self.on_synced = on_synced
        self.on_end = on_end
        self.links: dict[Sender, _Link] = {}
        # the last failure of each link, said once: the owner's dict outlives this set (a
        # follower builds a new one each time its cluster leader's link ends, and a failure
        # retried every 0.4 s was logged every time); ``reported``: links whose failures the
        # owner logs itself (from ``on_end``)
        self.errors: dict[Sender, str] = errors if errors is not None else {}
        self.reported = reported

    @property
    def synced(self) -> bool:
        return all(link.synced for link in self.links.values())

    def scopes(self) -> dict[Sender, Scope]:
        return {s: link.scope for s, link in self.links.items()}

    async def set(self, wanted: Mapping[Sender, Scope]) -> None:
        """Follow exactly ``wanted``: links that lose or change scope end (and their last batch
        is written) before any link that gains one opens."""
        senders = list(wanted)
        for i, s in enumerate(senders):
            for t in senders[i + 1:]:
                if wanted[s].overlaps(wanted[t]):
                    raise ValueError(f"{s} and {t} would both write files of one scope")
        ending = [s for s, link in self.links.items() if wanted.get(s) != link.scope]
        await self._end(ending)
        for s, scope in wanted.items():
            if s not in self.links:
                link = self.links[s] = _Link(scope)
                link.task = asyncio.ensure_future(self._run(s, link))

    async def close(self) -> None:
        await self._end(list(self.links))

    async def _end(self, senders: list[Sender]) -> None:
        tasks = [t for s in senders if (t := self.links.pop(s).task) is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if tasks:  # the single apply worker: past any batch an ended link was writing
            await asyncio.get_running_loop().run_in_executor(self.executor, lambda: None)

    async def _run(self, sender: Sender, link: _Link) -> None:
        def synced() -> None:
            link.synced = True
            self.errors.pop(sender, None)
            if self.synced:
                self.on_synced()

        while True:
            link.synced = False
            error: Exception | None = None
            try:
                await follower.follow(sender.host, sender.port, self.data_dir, self.secret(), self.node_id,
                                      lambda w: self.on_welcome(sender, w), synced, self.executor,
                                      self.source_ip, self.tls(), scope=link.scope)
            except Exception as exc:  # whatever ended the link, the owner hears of it
                error = exc
                text = str(exc) or type(exc).__name__
                if sender not in self.reported and self.errors.get(sender) != text:
                    self.errors[sender] = text
                    log.info("replication from %s:%d ended: %s", sender.host, sender.port, text)
            link.synced = False
            self.on_end(sender, error)
            await asyncio.sleep(RETRY)
