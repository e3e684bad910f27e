"""A node serving the shards it leads (step 2 of the per-shard data path, docs/architecture.md).

Theory of operation
-------------------
A node that leads shards without holding the cluster's leadership serves them with a broker of
their own: a ``ShardBroker`` (built by the composition root, ``Host.shard_broker``) on the
node's data dir, holding only the vhosts in ``served`` (each booted from the directory
replication wrote, ``open_shard``), with client listeners on loopback ports only: clients reach
it through this node's proxies, which tunnel a vhost's connection to the node serving it
(``proxy.py`` ``Routed``, ``cluster/tunnel.py``). The data dir's lock stays with the runner,
which keeps following the cluster leader for the shared files and the shards nobody else
serves (``follow_set.follow_plan`` leaves ours out).

Replication. A ``ShardedLeaderSink`` listens on the node's replication port: peers follow it,
scoped to the shards it serves (``files.Scope``), and the tunnels of other nodes' proxies end
there. Its group commits wait for each shard's ISR (``shard_barrier``); a shard's ISR is the
members holding it, and its etcd key is written by this node alone, fenced on its own term of
that shard (``Etcd.write_served_isr``; ``write_isr`` here), never on the cluster leadership.

What a follower is sent. The sink's file index (length and running hash of each file, the
bulk sync's listing) is read for a shard as it opens, from the files replication left, and
forgotten once it is handed over; a follower's scope must name only shards served here or
closed and not handed over yet (``_scope_refused``): a follower deletes, inside its scope,
whatever the listing lacks, so a listing from a copy we do not serve (or from entries that
counted only what we appended) would take back a confirmed queue.

A shard lost while others are served: a write of its ISR key refused for a term we no longer
hold fences that shard alone (``ShardedLeaderSink.lose``: its commits fail, their publishers
nacked, never confirmed) until the runner's next pass closes it; the sink, its followers and tunnels go on
for the shards we still hold.

Losing a shard (its key gone, resigned, or the lease presumed expired): ``close`` first takes
the vhost out of the broker and closes its clients with 320, so no confirm of it leaves this
node afterwards, then closes its stores; its files stay. Until it is handed over (``handed``:
released and marked served elsewhere, ``handover.py``) the closed shard is still replicated,
read-only: its index entries stay, a follower naming it is taken, and nothing writes it (no
client reaches it, and the runner's links leave it alone), so its holder can catch up with
its last action, which the release waits for. ``stop`` fences the sink first, so no barrier
resolves after it, then shuts the broker and the listener down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from broker.cluster.files import Scope, shard_name
from broker.cluster.host import Host, ShardBroker
from broker.cluster.shard_sink import ShardedLeaderSink
from broker.cluster.status import ClusterView
from broker.config import Config

log = logging.getLogger(__name__)

# Write the ISR key of vhost ``v``, fenced on our term of it: True/False/None as ``write_isr``.
ServedIsrWriter = Callable[[str, list[str]], Awaitable[bool | None]]


def shard_config(config: Config) -> Config:
    """The configuration of a node's shard broker: AMQP, and the management API, MQTT and the
    stream protocol when enabled, on loopback ports of the kernel's choosing (reached through the
    tunnels only, which the cluster leader's own ports open too: ``cluster/elsewhere.py``); no
    other listener (the metrics port too is a loopback one: the node's is the runner's)."""
    return dataclasses.replace(
        config,
        amqp=dataclasses.replace(config.amqp, bind="127.0.0.1", port=0, tls_port=-1, unix_path=""),
        mgmt=dataclasses.replace(config.mgmt, bind="127.0.0.1", port=0, tls_port=-1, unix_path="",
                                 metrics_bind="127.0.0.1", metrics_port=0),
        mqtt=dataclasses.replace(config.mqtt, bind="127.0.0.1", port=0, tls_port=-1, unix_path=""),
        stream=dataclasses.replace(config.stream, bind="127.0.0.1", port=0, tls_port=-1, unix_path="",
                                   **_stream_advertised(config)),
        lmq=dataclasses.replace(config.lmq, enabled=False),
        main=dataclasses.replace(config.main, load_definitions=""),
    )


def _stream_advertised(config: Config) -> dict[str, Any]:
    """What the shard broker's stream ``Open`` and ``Metadata`` name: the node's own stream port
    (which reaches the shard wherever it is served), never the loopback port clients cannot use."""
    s = config.stream
    host = s.advertised_host or ("" if s.bind in ("", "0.0.0.0", "::") else s.bind)
    return {"advertised_host": host, "advertised_port": s.advertised_port or max(s.port, 0)}


class ShardServer:
    """This node's broker for the shards it serves, and their replication (see above)."""

    def __init__(self, config: Config, host: Host, node_id: str, secret: bytes, view: ClusterView,
                 write_isr: ServedIsrWriter, lease_valid: Callable[[], bool]) -> None:
        self.config = config
        self.served: set[str] = set()  # vhost names
        self.closed: set[str] = set()  # closed, not handed over yet: replicated read-only
        self.write_served_isr = write_isr
        self.sink = ShardedLeaderSink(config.main.data_dir, node_id, secret, self._write_isr,
                                      self._write_shard_isr)
        self.sink.lease_valid = lease_valid
        self.sink.scope_refused = self._scope_refused

        def replicated(dirty: list[Any]) -> asyncio.Future[None]:
            return self.sink.shard_barrier()  # each shard's ISR (cluster/shard_sink.py)

        self.node: ShardBroker = host.shard_broker(shard_config(config), self.sink, view, replicated,
                                                   self.served.__contains__)
        self.running = False

    async def start(self, bind: str, port: int, tls: ssl.SSLContext | None = None) -> tuple[str, int]:
        """Boot the broker (no shard yet) and listen for followers and tunnels; the address."""
        sink, node = self.sink, self.node  # its index reads each shard as it opens (``open``)
        await node.start()
        node.trust_proxy_headers_from(sink.member_ips)
        sink.flush_stores = node.flush_stores
        sink.merge_acks = node.merge_acks
        sink.client_addresses = node.client_addresses
        sink.proxied_peers = node.proxied_peers
        sink.proxied_tls = node.proxied_tls
        try:
            address = await sink.start(bind, port, tls)
        except BaseException:
            await node.shutdown()
            raise
        self.running = True
        return address

    async def open(self, vhost: str) -> bool:
        """Serve ``vhost`` (its replicated directory); False if unknown or served already."""
        if vhost in self.served:
            return False
        shard = shard_name(vhost)

        async def write(members: list[str]) -> bool | None:
            return await self.write_served_isr(vhost, self.sink.shard_members(shard, members))

        # the shard's files as replication left them (written since our index was read, or
        # since we last served it): our followers' bulk syncs compare against these entries,
        # and delete whatever they do not list
        await asyncio.get_running_loop().run_in_executor(None, self.sink.index.scan, shard)
        self.sink.lost.discard(shard)  # ours again, a new term
        self.closed.discard(vhost)
        self.served.add(vhost)
        if not await self.node.open_shard(vhost):
            self.served.discard(vhost)
            return False
        # its ISR key is ours before any client reaches it (the routers go by the serving mark,
        # written after this): the key the cluster leader wrote names members that will not
        # hold what we confirm before they follow us
        if await self.sink.isr_written(write) is not True:
            await self.close(vhost, "its ISR key could not be written")
            return False
        return True

    async def close(self, vhost: str, reason: str) -> None:
        """Stop serving ``vhost``, fenced (``Node.close_shard``); its files stay, and so does
        its replication, read-only, until it is ``handed`` over."""
        self.served.discard(vhost)
        self.closed.add(vhost)
        await self.node.close_shard(vhost, reason)

    def handed(self, vhost: str) -> None:
        """``vhost``, closed here, is served elsewhere now: its next server's stream writes
        its files from here on, and a follower naming it is refused."""
        if vhost in self.closed:
            self.closed.discard(vhost)
            self.sink.index.forget(shard_name(vhost))

    async def stop(self) -> None:
        self.running = False
        self.sink.fence()  # no barrier resolves from here on: no confirm leaves after this
        self.served.clear()
        self.closed.clear()
        await self.node.shutdown()
        await self.sink.stop()

    def _scope_refused(self, scope: Scope) -> str | None:
        """A follower takes from us only shards we serve, or closed and not handed over yet
        (its holder catches up with them here): of any other our copy may be stale, and its
        bulk sync would delete what that shard's server confirmed."""
        ours = {shard_name(v) for v in self.served | self.closed}
        if scope.shared or scope.shards is None:
            return "a shard server sends only the shards it serves, named"
        if not scope.shards <= ours:
            return f"shards not served here: {sorted(scope.shards - ours)}"
        return None

    async def _write_isr(self, members: list[str]) -> bool | None:
        """The sink's ISR changed: each served shard's key, its members less those behind on it.
        A shard whose term we lost stops confirming (``_lost``); the others go on."""
        result: bool | None = True
        for vhost in sorted(self.served):
            shard = shard_name(vhost)
            ok = await self.write_served_isr(vhost, self.sink.shard_members(shard, members))
            if ok is False:
                self._lost(vhost)
            elif ok is None:
                result = None  # etcd unreachable: the sink retries
        return result

    async def _write_shard_isr(self, shard: str, members: list[str]) -> bool | None:
        vhost = next((v for v in self.served if shard_name(v) == shard), None)
        if vhost is None:
            return True  # closed meanwhile: its next server writes its key
        ok = await self.write_served_isr(vhost, members)
        if ok is False:
            self._lost(vhost)
            return True
        return ok

    def _lost(self, vhost: str) -> None:
        """Our term of ``vhost`` is gone (the runner's next pass closes it): its commits fail
        from here on (nacked, never confirmed), and the sink keeps serving our other shards (a
        fenced sink would drop every follower and tunnel of every shard we serve)."""
        if shard_name(vhost) not in self.sink.lost:
            log.warning("shard %r: our term is gone, its confirms stop until it closes", vhost)
        self.sink.lose(shard_name(vhost))
