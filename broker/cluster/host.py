"""What the cluster runner needs from the composition root, as a small interface.

The runner decides *when* this node serves (elected, fenced, stepping down); the
composition root (``broker.node``) knows *how* a broker is built. The runner never
imports the node: ``serve_clustered(config, host)`` receives a ``Host`` that builds a
``LeaderBroker`` on the replicated data dir and a ``MetricsServer`` for the cluster gauges
while following. A test that needs a fault (a disk whose fsync stalls) supplies its own
host wrapping the real one: the fault seam belongs to the test, not to production code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

from broker.cluster.etcd import Etcd
from broker.cluster.handover import Seen
from broker.cluster.status import ClusterView
from broker.config import Config
from broker.store.sink import ReplicationSink
from broker.tls import PeerTLS


class ClusterState(Protocol):
    """The live cluster view the leader's metrics and ``GET /api/cluster`` read."""

    def is_leader(self) -> bool: ...

    def follower_lags(self) -> dict[str, int]: ...

    def status(self) -> dict[str, Any]: ...


class VhostCarrier(Protocol):
    """Carries a connection for a vhost another node serves (``cluster/elsewhere.py``); the
    broker's sessions see it as their shard map (``broker.amqp.broker.Shards``)."""

    replays_login: bool

    def elsewhere(self, vhost: str) -> bool:
        """Another node serves ``vhost``: hand the connection over."""

    def hand_over(self, fd: int, state: dict[str, Any]) -> None:
        """Carry the connection (``fd``, duplicated by the call) and its negotiated ``state``
        (with the client's start-ok, ``login``) to that node."""

    def server_of(self, vhost: str) -> str | None:
        """The node serving ``vhost`` when another one does, None when served here."""

    async def open_http(self, vhost: str, client: tuple[str, int], which: int = ...
                        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the management API of the node serving ``vhost``, for ``client``
        (None: not served elsewhere)."""

    async def open_nodes(self, client: tuple[str, int], metrics: bool = False) -> tuple[
            list[tuple[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]]], list[str]]:
        """A connection to the management API of each other node serving a vhost, for ``client``,
        each named by its vhosts (``metrics``: to its metrics port); and the vhosts moving (no node
        serves them yet)."""

    async def open_members(self, client: tuple[str, int]) -> list[
            tuple[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
        """A connection to the management API of every other live member, for ``client``, by
        node id (``GET /api/nodes``)."""


class LeaderBroker(Protocol):
    """A broker serving clients from the data dir while this node leads."""

    stopping: asyncio.Event  # set when the broker wants to stop (SIGTERM)

    async def start(self) -> None:
        """Lock the data dir, load it, open the client listeners."""

    async def shutdown(self) -> None:
        """Close the listeners and every store (their last bytes go through the sink)."""

    def release_lock(self) -> None: ...

    def client_addresses(self) -> dict[str, tuple[str, int]]:
        """The bound address of every client listener that listens, by ``codec.PORT_NAMES``
        (``amqp``, ``http``, ``amqps``, ``https``, ``lmq_http``, ``lmq_rpc``, ``mqtt``, ``stream``)."""

    @property
    def proxied_peers(self) -> MutableMapping[tuple[str, int], tuple[str, int]]:
        """A live map the listeners read: a local connection's address -> the client it carries
        (the leader's own legs of follower tunnels, ``broker.cluster.tunnel``)."""

    @property
    def proxied_tls(self) -> MutableMapping[tuple[str, int], PeerTLS]:
        """A live map the AMQP listener reads: such a local connection's address -> the client's
        TLS the member that carried it ended (its certificate for EXTERNAL)."""

    def reload_tls(self) -> None:
        """Reload the client listeners' certificates (SIGHUP)."""

    def sync_started(self) -> float | None:
        """Monotonic start of the fsync running now, else None (the stalled-disk watchdog)."""

    def flush_stores(self) -> None:
        """Push every queue store's buffered acks and meta to the sink."""

    def merge_acks(self, path: Path, positions: list[int]) -> int:
        """Ack the ready messages a follower's ack file ``path`` (ours: same data dir layout)
        names; returns how many were acked."""

    def trust_proxy_headers_from(self, peers: set[str]) -> None:
        """Accept PROXY protocol headers from the addresses in ``peers`` (a live set: the
        followers that authenticated, whose proxies splice clients to us)."""

    # per-shard leaders: the vhosts this broker holds (None: every one), set before ``start``
    serves: Callable[[str], bool] | None
    # shard servers: who carries a connection for a vhost another node serves (None: 530)
    elsewhere: VhostCarrier | None

    async def open_shard(self, name: str) -> bool:
        """Serve vhost ``name`` from its replicated directory; False if unknown or served."""

    async def close_shard(self, name: str, reason: str = ...) -> bool:
        """Stop serving ``name``, fenced (its clients closed first); its files stay."""


class ShardBroker(LeaderBroker, Protocol):
    """A broker holding only the shards this node serves (``cluster/shard_server.py``)."""

    # the client listeners of this member (its proxies' ports, by RabbitMQ's protocol names),
    # which the overview lists for it rather than the broker's loopback ones
    advertised: Callable[[], list[tuple[str, tuple[str, int]]]] | None

    def reload_shared(self) -> list[str]:
        """Re-read the shared files replication replaced (users, vhosts, global parameters)."""


class ShardElection(Protocol):
    """Per-shard leadership (``[clustering] shard_leaders``, ``broker/shards/leaders.py``)."""

    closed: set[str]  # the vhosts the cluster leader's broker closed (served elsewhere soon)

    async def run(self) -> None:
        """Campaign for, hold and hand back shards until cancelled."""

    async def drain(self) -> None:
        """The node is stopping (``run`` cancelled): hand every shard held over now."""

    def vhosts(self) -> list[str]:
        """The shards (vhost names) of this node's data dir: a leader writes each one's ISR."""

    def replicated(self) -> list[str]:
        """The vhosts whose ISR keys this node writes as the cluster leader: every one no other
        node serves (that node writes its own, ``Etcd.write_served_isr``)."""

    def serving(self) -> dict[str, str]:
        """The shards (vhost directories) whose leader serves them, with its replication URI."""

    def live_members(self) -> dict[str, dict[str, Any]]:
        """Every live member's record (``<prefix>/members/<id>``) by node id, as last read."""

    def ready(self) -> bool:
        """A pass has read the shards' keys since this node started."""

    def seen(self) -> dict[str, Seen]:
        """Each shard's keys (vhost -> ``handover.Seen``) as the last pass read them."""

    async def mark_served(self, vhost: str) -> bool:
        """Say in ``vhost``'s leader key (ours) that this node serves it."""

    def term_of(self, vhost: str) -> int | None:
        """Our term of ``vhost``'s shard (None: we do not lead it)."""


class MetricsServer(Protocol):
    @property
    def running(self) -> bool: ...

    async def start(self, bind: str, port: int) -> None: ...

    async def stop(self) -> None: ...


Replicated = Callable[[list[Any]], "asyncio.Future[None]"]


class Host(Protocol):
    def leader_broker(self, config: Config, sink: ReplicationSink, cluster: ClusterState,
                      replicated: Replicated) -> LeaderBroker:
        """A broker to start as leader: confirms wait for ``replicated(dirty)`` (the ISR)."""

    def shard_broker(self, config: Config, sink: ReplicationSink, cluster: ClusterState,
                     replicated: Replicated, serves: Callable[[str], bool]) -> ShardBroker:
        """A broker on this node's data dir (whose lock the runner holds) serving only the
        vhosts ``serves`` names (``cluster/shard_server.py``)."""

    def reload(self, leader: LeaderBroker | None) -> None:
        """SIGHUP: re-read the configuration and apply what can change at runtime (``leader``:
        the broker this node runs while it leads, else None)."""

    def follower_metrics(self, cluster: ClusterState, data_dir: Path, cluster_name: str) -> MetricsServer:
        """The cluster gauges (and this node's process and disk metrics, labelled with
        ``cluster_name``) on the metrics port while this node follows."""

    def amqp_server_properties(self) -> dict[str, Any]:
        """What the broker's connection.start says (a follower routing AMQP by vhost says it first)."""

    def shard_election(self, config: Config, etcd: Etcd, node_id: str, uri: str,
                       view: ClusterView) -> ShardElection:
        """This node's per-shard election loop (run while ``[clustering] shard_leaders`` is on);
        it shares the runner's etcd client and lease and shows its map in ``view``."""
