"""What the management API and /metrics share: the broker plus node-level facts.

``Mgmt`` is built by the node (composition root) and handed to the HTTP app and
the metrics collector. Besides the live ``Broker`` it holds the persisted vhost
list, the policy views, the rate sampler and the node's listener addresses, and
it owns the two operations the model has no home for yet: creating a vhost
(``VHost`` object + ``vhosts.json`` entry) and deleting one (close its
connections, delete its queues, close its definitions log, remove its
directories, drop permissions and policies).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from broker import errors, metrics
from broker.auth.parameters import GlobalParameters, RuntimeParameters
from broker.auth.vhosts import VHostStore
from broker.http.policies import PolicyApi, import_legacy
from broker.http.rates import RateSampler
from broker.http.records_budget import RecordsBounds
from broker.model.vhost import VHost

if TYPE_CHECKING:
    from broker.metrics import ClusterInfo
    from broker.views import BrokerView, ConnectionView, FrontEndView


class Intent(Protocol):
    """A multi-file change written down whole before it is applied (``broker/store/intent.py``)."""

    def pending(self) -> Any: ...

    def begin(self, change: Any) -> None: ...

    def done(self) -> None: ...


class NoIntent:
    """Nowhere to write a change down (a Mgmt without a data dir of its own, in unit tests)."""

    def pending(self) -> Any:
        return None

    def begin(self, change: Any) -> None:
        pass

    def done(self) -> None:
        pass


class ShovelsView(Protocol):
    """What the API reads and does of the node's shovels (``broker/shovel/manager.py``)."""

    def status(self, vhost: str | None = None) -> list[dict[str, Any]]: ...

    def restart(self, vhost: str, name: str) -> bool: ...

    def pause(self, vhost: str, name: str) -> bool: ...

    def resume(self, vhost: str, name: str) -> bool: ...


class AppControl(Protocol):
    """The node's messaging side as ``skredctl stop_app``/``start_app`` reach it
    (``broker/http/routes_app.py``; the node implements it, ``broker/node.py``)."""

    @property
    def app_running(self) -> bool: ...

    async def stop_app(self) -> None: ...

    async def start_app(self) -> None: ...


class Mgmt:
    def __init__(
        self,
        broker: BrokerView,
        vhost_store: VHostStore,
        make_vhost: Callable[[str], VHost],
        data_dir: Path,
        transient_root: Path,
        global_parameters: GlobalParameters,
        import_intent: Intent | None = None,
        parameters: RuntimeParameters | None = None,
    ) -> None:
        self.broker = broker
        self.global_parameters = global_parameters  # RabbitMQ's global runtime parameters
        # vhost-scoped runtime parameters (shovels, federation); None: no component is served
        self.parameters = parameters
        self.shovels: ShovelsView | None = None  # set by the node when it runs shovels
        self.app: AppControl | None = None  # set by a node that can stop and start its app
        # the federation links' status (broker/federation), set by the node that runs them
        self.federation_links: Callable[[str | None], list[dict[str, Any]]] = lambda vhost: []
        # a definitions import in progress (broker/http/definitions.py: all or nothing)
        self.import_intent: Intent = import_intent if import_intent is not None else NoIntent()
        self.import_lock = asyncio.Lock()  # one import at a time (it lets the loop run meanwhile)
        self.vhost_store = vhost_store
        self.make_vhost = make_vhost
        self.data_dir = data_dir
        self.transient_root = transient_root
        # Policies live in the vhosts (applied live); the API only maps onto them.
        self.policies = PolicyApi(broker)
        self.operator_policies = PolicyApi(broker, operator=True)
        import_legacy(data_dir / "policies.json", self.policies)
        # the protocol front ends beside AMQP (MQTT), added by the node
        self.front_ends: list[FrontEndView] = []
        self.vhost_deleted: list[Callable[[str], None]] = []  # the node's: a front end's state of it
        self.rates = RateSampler(broker, self.node_gauges, connections=self.connections)
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self.node_name = metrics.node_name()
        self.cluster_name = self.node_name
        self.amqp_address: tuple[str, int] | None = None
        self.amqps_address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None
        self.https_address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.other_listeners: dict[str, tuple[str, int]] = {}  # other front ends: "mqtt", "mqtt/ssl"
        self.advertised: Callable[[], list[tuple[str, tuple[str, int]]]] | None = None  # set by the node
        self.member_name = ""  # a cluster member's shard broker: its member's node name (``listed_name``)
        # stream protocols served over WebSocket on this port ("amqp", "mqtt"), set by the node
        self.websocket_protocols: dict[str, Callable[[tuple[str, int]], asyncio.Protocol]] = {}
        self.websocket_max_message = 1 << 20
        self.records = RecordsBounds()  # the raw records answers' memory and time bounds, set by the node
        self.tls_certs: list[str] = []  # certificate files, for the certificate-expiration check
        self.cluster: ClusterInfo | None = None  # set on a cluster member (metrics, GET /api/cluster)
        # set by the node before the app is built: a worker's fan-out to the others (broker/shards)
        self.middlewares: list[Any] = []
        self.metrics_middlewares: list[Any] = []  # the same for the metrics port

    # ------------------------------------------------------------------ helpers
    @property
    def listed_name(self) -> str:
        """The name ``/api/nodes`` and the overview's listeners give this node: a shard broker's
        is its member's (its own ``node_name`` is that of its loopback AMQP port)."""
        return self.member_name or self.node_name

    def client_listeners(self) -> list[tuple[str, tuple[str, int]]]:
        """The listeners a client of this node connects to, as the overview lists them: a
        cluster member's shard broker's are its member's proxies (``advertised``), not its own
        loopback ones."""
        return self.advertised() if self.advertised is not None else self.listeners()

    def listeners(self) -> list[tuple[str, tuple[str, int]]]:
        """Every client listener that listens, as (RabbitMQ's protocol name, address)."""
        found = [("amqp", self.amqp_address), ("amqp/ssl", self.amqps_address), ("http", self.http_address),
                 ("https", self.https_address), ("http/prometheus", self.metrics_address),
                 *self.other_listeners.items()]
        return [(proto, addr) for proto, addr in found if addr is not None]

    def replica_members(self) -> list[str]:
        """A replicated queue's members as the API lists them: this node (the leader), then the
        other in-sync replicas of a cluster by their cluster node id (a follower's
        ``name@host`` node name is not known to the leader)."""
        members = [self.node_name]
        if self.cluster is not None and self.cluster.is_leader():
            status = self.cluster.status()
            members.extend(str(n) for n in status.get("isr", ()) if n != status.get("node_id"))
        return members

    def node_gauges(self) -> tuple[int, ...]:
        """``rates.GAUGE_FIELDS`` now, sampled every second for their ``*_details`` rates."""
        return (self.resident_memory(), self.disk_free(), self.open_fds(),
                len(self.connections()), 1)

    def uptime_seconds(self) -> float:
        return time.monotonic() - self.started_mono

    def connections(self) -> list[ConnectionView]:
        """Every open connection: AMQP's, then each front end's."""
        out: list[ConnectionView] = list(self.broker.connections)
        for front_end in self.front_ends:
            out.extend(front_end.open_connections())
        return out

    def connection_name(self, session: ConnectionView) -> str:
        """RabbitMQ's connection name: ``peer:port -> local:port``."""
        host, port = self.local_address(session)
        return f"{session.peer[0]}:{session.peer[1]} -> {host}:{port}"

    def local_address(self, session: ConnectionView) -> tuple[str, int]:
        """The listener a connection came in on (by its ``listener`` name)."""
        found = dict(self.listeners()).get(session.listener)
        if found is not None:
            return found
        return self.amqp_address or ("127.0.0.1", 5672)

    def find_connection(self, name: str) -> ConnectionView | None:
        for session in self.connections():
            if name in (self.connection_name(session), session.name):
                return session
        return None

    def close_connection(self, session: ConnectionView, reason: str) -> None:
        session.close_connection(errors.ConnectionForced(reason))
        session.wakeup()

    # ------------------------------------------------------------------- vhosts
    def create_vhost(self, name: str) -> VHost:
        """Persist the name, then build the ``VHost`` (raises ValueError on a bad/duplicate name)."""
        self.vhost_store.add(name)
        try:
            vh = self.make_vhost(name)
        except BaseException:
            self.vhost_store.delete(name)
            raise
        self.broker.vhosts[name] = vh
        return vh

    def delete_vhost(self, name: str) -> None:
        vh = self.broker.vhosts.get(name)
        if vh is None:
            raise KeyError(name)
        self.vhost_store.delete(name)  # first: on a full disk (DiskFull) nothing is deleted
        del self.broker.vhosts[name]
        for session in self.connections():
            if session.vhost == name:
                self.close_connection(session, f"vhost '{name}' is deleted")
        syncer = self.broker.syncer
        for q in list(vh.queues.values()):
            syncer.discard(q.store)
            try:
                vh.delete_queue(q.name, owner=q.exclusive_owner)
            except errors.DiskFull:  # not logged: the definitions log goes with the vhost
                q.delete()
        syncer.discard(vh.definitions)
        vh.close()
        vh.remove_files()  # renamed away now (the name may be created again at once), removed later
        for forget in self.vhost_deleted:  # MQTT's retained messages and sessions went with its dir
            forget(name)
        self.broker.users.clear_vhost(name)
        self.policies.clear_vhost(name)
        if self.parameters is not None:
            self.parameters.clear_vhost(name)

    # ---------------------------------------------------------------- process
    def disk_free(self) -> int:
        return metrics.disk_free(self.data_dir)

    resident_memory = staticmethod(metrics.resident_memory)
    open_fds = staticmethod(metrics.open_fds)
    max_fds = staticmethod(metrics.max_fds)
