"""Prometheus metrics, collected at scrape time from counters the broker already keeps.

Theory of operation
-------------------
``SkredCollector`` is a prometheus-client custom collector registered in a
private ``CollectorRegistry``. Nothing is updated per message: at each scrape
it reads ``Broker.stats`` (global integer counters), each queue's counters and
store sizes, the connection set, and a few process facts (resident memory, open
file descriptors, free disk space under the data dir), and yields metric
families named like RabbitMQ's (``rabbitmq_queue_messages_ready`` becomes
``skred_queue_messages_ready``; LavinMQ does the same with its prefix).

Counters summed over queues (redelivered) must never go down, but a deleted
queue takes its counter with it; the collector remembers the last value it saw
of every queue and adds the values of vanished queues to a ``retired`` total, so
the sum stays monotonic (increments after the last scrape of a deleted queue are
lost, which Prometheus' ``rate()`` tolerates).

``render(family=..., vhost=...)`` serves ``/metrics/detailed``: per-queue and
per-vhost series, selected by RabbitMQ's family names.

Cluster members: ``Mgmt.cluster`` (set by the cluster runner, None on a
standalone node) is any object with the ``ClusterInfo`` methods;
``ClusterCollector`` reads it at scrape time for ``skred_is_leader``,
``skred_connected_followers`` and ``skred_follower_lag_in_bytes{id}``. A
follower runs no broker: ``FollowerMetrics`` serves ``cluster_registry(view)`` on
the metrics port while it follows (the node hands it to the cluster runner); it
holds the ``NodeCollector`` too, so every node exports its own process, memory and
disk metrics.

RabbitMQ's names, alongside Skred's own
---------------------------------------
RabbitMQ users' dashboards and alerts query the ``rabbitmq_prometheus`` plugin's
names and join every series on ``instance`` with ``rabbitmq_identity_info``
(labels ``rabbitmq_node``, ``rabbitmq_cluster``). The same scrape therefore also
yields those: ``NodeCollector`` (identity, build info, process, memory and disk
of this node, on leaders, followers and standalone nodes alike) and
``RabbitCollector`` (the aggregated object and channel counters of
``GET /metrics``). ``/metrics/per-object`` adds one series per queue with
``vhost``/``queue`` labels, and ``/metrics/detailed?family=...&vhost=...``
answers both Skred's ``skred_detailed_*`` and RabbitMQ's ``rabbitmq_detailed_*``
names for the families RabbitMQ defines there. Deliveries and gets are counted
by ack mode as RabbitMQ does (``..._delivered_total`` / ``..._get_total`` without
acknowledgement, the ``_ack_total`` variants with it); the memory "limit" is the
memory high watermark (the machine's RAM when the memory alarm is off;
docs/flow-control.md).

``GlobalCollector`` yields RabbitMQ's ``rabbit_global_counters`` (``rabbitmq_global_*``,
what RabbitMQ's own Overview dashboard reads) and the body size histogram
``rabbitmq_message_size_bytes``. Nothing new is counted per message for them but a
body's size bucket (``broker.amqp.sizes``, once per run on the fast path): they are
``Broker.stats`` read another way, the open channels' own counts (publishes in
confirm mode, publishers, consumers) plus what closed channels left in the stats, and
per-queue totals (routed, redelivered) kept monotonic by ``QueueTotals``. Every
scrape's ``rabbitmq_identity_info`` says its endpoint (``rabbitmq_endpoint``:
aggregated, per-object, detailed), as RabbitMQ's does; the dashboard selects on it.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from broker import __version__

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from aiohttp import web  # imported when a follower's metrics listener starts: aiohttp's

    # import builds TLS contexts, a tenth of a boot's CPU before the client ports open
    from broker.views import BrokerView, ConnectionView, FrontEndView

PREFIX = "skred"
RABBIT = "rabbitmq"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DETAILED_FAMILIES = ("queue_coarse_metrics", "queue_consumer_count", "queue_delivery_metrics",
                     "vhost_status", "vhost_coarse_metrics")
RABBITMQ_VERSION = "3.13.7"  # the RabbitMQ release whose plugin names these series follow


# ------------------------------------------------------------------- process facts
DEFAULT_AMQP_PORT = 5672


def node_name(configured: str = "", amqp_port: int = DEFAULT_AMQP_PORT) -> str:
    """This node's name as RabbitMQ writes node names, ``name@host``: the configured one
    (``[main] node_name``; the host is appended when it has no ``@``), else ``skred@HOST``,
    or ``skred-PORT@HOST`` when the AMQP port is not the default one: two nodes on one host
    cannot share an AMQP port, so their names differ, and the name survives restarts."""
    host = socket.gethostname()
    if configured:
        return configured if "@" in configured else f"{configured}@{host}"
    if amqp_port in (DEFAULT_AMQP_PORT, 0) or amqp_port < 0:
        return "skred@" + host
    return f"skred-{amqp_port}@{host}"


def disk_free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def resident_memory() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def total_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return 0


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def max_fds() -> int:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _g(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _c(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ClusterInfo(Protocol):
    """What a cluster member tells metrics and ``GET /api/cluster`` (see broker.cluster.status)."""

    def is_leader(self) -> bool: ...

    def follower_lags(self) -> dict[str, int]: ...

    def status(self) -> dict[str, Any]: ...


class Source(Protocol):
    """What the collectors read (the management state, ``broker.http.state.Mgmt``)."""

    @property
    def broker(self) -> BrokerView: ...
    @property
    def node_name(self) -> str: ...
    @property
    def cluster_name(self) -> str: ...
    @property
    def cluster(self) -> ClusterInfo | None: ...
    @property
    def data_dir(self) -> Path: ...
    @property
    def front_ends(self) -> Sequence[FrontEndView]: ...

    def uptime_seconds(self) -> float: ...

    def connections(self) -> Sequence[ConnectionView]:
        """Every protocol's open connections (AMQP's and each front end's)."""

    def resident_memory(self) -> int: ...

    def open_fds(self) -> int: ...

    def max_fds(self) -> int: ...

    def disk_free(self) -> int: ...


class ClusterCollector(Collector):
    """Cluster gauges, read from ``source()`` at scrape time; nothing when it returns None.

    With per-shard leaders (``[clustering] shard_leaders``) also one ``skred_shard_leader``
    sample per shard, labelled with the shard and its leader's node id, 1 on the leader's own
    scrape and 0 on the others' (``sum by (node)`` over the cluster counts the shards each node
    leads), and, where the shard's data is served, its queue and
    message counts (``broker``: the broker serving them)."""

    def __init__(self, source: Callable[[], ClusterInfo | None],
                 broker: Callable[[], BrokerView] | None = None) -> None:
        self.source = source
        self.broker = broker

    def collect(self) -> Iterator[Metric]:
        info = self.source()
        if info is None:
            return
        lags = info.follower_lags()
        yield _g("is_leader", "1 if this node is the cluster leader, else 0", 1 if info.is_leader() else 0)
        yield _g("connected_followers", "Followers connected to this node's replication port", len(lags))
        lag = GaugeMetricFamily(f"{PREFIX}_follower_lag_in_bytes",
                                "Replication bytes sent (or held) but not yet acked, per follower",
                                labels=["id"])
        for node_id, value in sorted(lags.items()):
            lag.add_metric([node_id], value)
        yield lag
        yield from self._shards(info.status())

    def _shards(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        shards = status.get("shards")
        if shards is None:
            return
        me = status.get("node_id")
        led = GaugeMetricFamily(f"{PREFIX}_shard_leader",
                                "1 if this node leads the shard (node: its leader's id, empty while "
                                "it has none), else 0", labels=["shard", "node"])
        for shard in shards:
            leader = shard.get("leader") or ""
            led.add_metric([shard["vhost"], leader], 1 if leader == me else 0)
        yield led
        if self.broker is None:
            return
        queues = GaugeMetricFamily(f"{PREFIX}_shard_queues", "Queues of the shards this node serves",
                                   labels=["shard"])
        messages = GaugeMetricFamily(f"{PREFIX}_shard_messages",
                                     "Ready plus unacknowledged messages of the shards this node serves",
                                     labels=["shard"])
        for name, vh in sorted(self.broker().vhosts.items()):
            queues.add_metric([name], len(vh.queues))
            messages.add_metric([name], sum(q.message_count + q.store.unacked_count
                                            for q in vh.queues.values()))
        yield queues
        yield messages


AGGREGATED, PER_OBJECT, DETAILED = "aggregated", "per-object", "detailed"  # RabbitMQ's endpoint names


class IdentityCollector(Collector):
    """``rabbitmq_identity_info`` and ``rabbitmq_build_info``. ``rabbitmq_endpoint`` says which
    scrape it is (``aggregated`` for ``/metrics``, ``per-object``, ``detailed``): RabbitMQ's
    dashboards select on it, so that one node scraped on two endpoints counts once."""

    def __init__(self, identity: Callable[[], tuple[str, str]], endpoint: str) -> None:
        self.identity = identity  # -> (node name, cluster name), read at scrape time
        self.endpoint = endpoint

    def collect(self) -> Iterator[Metric]:
        node, cluster = self.identity()
        ident = InfoMetricFamily(
            f"{RABBIT}_identity", "RabbitMQ-style node identity: join on instance",
            labels=["rabbitmq_node", "rabbitmq_cluster", "rabbitmq_cluster_permanent_id",
                    "rabbitmq_endpoint"])
        ident.add_metric([node, cluster, cluster, self.endpoint], {})
        yield ident
        build = InfoMetricFamily(f"{RABBIT}_build", "Versions (RabbitMQ's label names)",
                                 labels=["rabbitmq_version", "prometheus_plugin_version",
                                         "prometheus_client_version", "erlang_version", "product",
                                         "product_version", "python_version"])
        build.add_metric([RABBITMQ_VERSION, __version__, __version__, "none", "Skred", __version__,
                          platform.python_version()], {})
        yield build


class NodeCollector(Collector):
    """This node's identity, build, process, memory and disk, in RabbitMQ's names and Skred's."""

    def __init__(self, data_dir: Path, identity: Callable[[], tuple[str, str]],
                 disk_limit: Callable[[], int] = lambda: 0, sockets: Callable[[], int] = lambda: 0,
                 memory_limit: Callable[[], int] = lambda: 0, endpoint: str = AGGREGATED) -> None:
        self.data_dir = data_dir
        self.identity = IdentityCollector(identity, endpoint)
        self.disk_limit = disk_limit
        self.sockets = sockets
        self.memory_limit = memory_limit  # the memory high watermark (0: off)

    def collect(self) -> Iterator[Metric]:
        yield from self.identity.collect()
        memory, fds, limit_fds = resident_memory(), open_fds(), max_fds()
        free = disk_free(self.data_dir)
        doc_mem = "Resident memory of the broker process"
        doc_disk = "Free bytes on the data directory's file system"
        yield _g("process_resident_memory_bytes", doc_mem, memory)  # Skred's names ...
        yield _g("process_open_fds", "Open file descriptors", fds)
        yield _g("process_max_fds", "File descriptor limit", limit_fds)
        yield _g("disk_space_available_bytes", doc_disk, free)
        yield _rg("process_resident_memory_bytes", doc_mem, memory)  # ... and RabbitMQ's
        yield _rg("process_open_fds", "Open file descriptors", fds)
        yield _rg("process_max_fds", "File descriptor limit", limit_fds)
        yield _rg("disk_space_available_bytes", doc_disk, free)
        yield GaugeMetricFamily(f"{RABBIT}_resident_memory_limit_bytes",
                                "Memory high watermark (the machine's RAM when off)",
                                value=self.memory_limit() or total_memory())
        yield GaugeMetricFamily(f"{RABBIT}_disk_space_available_limit_bytes",
                                "Free disk space below which publishers are blocked", value=self.disk_limit())
        yield GaugeMetricFamily(f"{RABBIT}_process_open_tcp_sockets", "Open client sockets",
                                value=self.sockets())
        yield GaugeMetricFamily(f"{RABBIT}_process_max_tcp_sockets", "Socket limit (the fd limit)",
                                value=limit_fds)


def cluster_registry(info: ClusterInfo, data_dir: Path | None = None,
                     cluster_name: str = "", name: str = "") -> CollectorRegistry:
    """A follower's metrics port: the cluster gauges and, given its data dir, its own node
    metrics (labelled ``name``, the node's name, see ``node_name``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(lambda: info))
    if data_dir is not None:
        me = name or node_name()
        registry.register(NodeCollector(data_dir, lambda: (me, cluster_name or me)))
    return registry


class QueueTotals:
    """Per-queue counters summed over every queue, kept monotonic across deletes: the last
    value seen of a queue that is gone (or whose id a new queue took, seen as a value that
    went down) moves to a retired total. Read at scrape time, nothing per message."""

    def __init__(self, mgmt: Source, attrs: Sequence[str]) -> None:
        self.mgmt = mgmt
        self.attrs = tuple(attrs)
        self._seen: dict[int, tuple[int, ...]] = {}
        self._retired = [0] * len(self.attrs)

    def totals(self) -> dict[str, int]:
        attrs, retired, seen = self.attrs, self._retired, self._seen
        current: dict[int, tuple[int, ...]] = {}
        for vh in self.mgmt.broker.vhosts.values():
            for q in vh.queues.values():
                values = tuple(getattr(q, a) for a in attrs)
                key = id(q)
                before = seen.get(key)
                if before is not None and any(v < b for v, b in zip(values, before, strict=True)):
                    for i, b in enumerate(before):  # another queue at a recycled id
                        retired[i] += b
                current[key] = values
        for key, values in seen.items():
            if key not in current:
                for i, v in enumerate(values):
                    retired[i] += v
        self._seen = current
        sums = [sum(col) for col in zip(*current.values(), strict=True)] or [0] * len(attrs)
        return {a: r + v for a, r, v in zip(attrs, retired, sums, strict=True)}


class SkredCollector(Collector):
    def __init__(self, mgmt: Source) -> None:
        self.mgmt = mgmt
        self.queue_totals = QueueTotals(mgmt, ("n_redelivered", "n_published"))

    def redelivered_total(self) -> int:
        return self.queue_totals.totals()["n_redelivered"]

    def collect(self) -> Iterator[Metric]:
        mgmt = self.mgmt
        broker = mgmt.broker
        stats = broker.stats
        sessions = [s for s in broker.connections]
        opened, others = _front_end_connections(mgmt)
        queues = [q for vh in broker.vhosts.values() for q in vh.queues.values()]
        ready = sum(q.message_count for q in queues)
        unacked = sum(q.store.unacked_count for q in queues)
        info = InfoMetricFamily(f"{PREFIX}_identity", "Node identity", labels=["node", "cluster", "version"])
        info.add_metric([mgmt.node_name, mgmt.cluster_name, __version__], {})
        yield info
        yield _g("uptime_seconds", "Seconds since the node started", mgmt.uptime_seconds())
        yield _g("connections", "Open connections (AMQP, MQTT)", len(sessions) + others)
        yield _g("channels", "Open AMQP channels", sum(len(s.chs) for s in sessions))
        yield _g("consumers", "Consumers on all queues", sum(len(q.consumers) for q in queues))
        yield _g("queues", "Queues in all vhosts", len(queues))
        yield _g("queues_paused", "Paused queues (publishes taken, nothing delivered)",
                 sum(q.paused for q in queues))
        yield _g("exchanges", "Exchanges in all vhosts",
                 sum(len(vh.exchanges) for vh in broker.vhosts.values()))
        yield _g("bindings", "Bindings in all vhosts (default exchange included)",
                 sum(len(ex.bindings()) for vh in broker.vhosts.values() for ex in vh.exchanges.values()))
        yield _g("vhosts", "Virtual hosts", len(broker.vhosts))
        yield _g("users", "Users", len(broker.users.list()))
        yield _g("queue_messages_ready", "Messages ready for delivery in all queues", ready)
        yield _g("queue_messages_unacked", "Messages delivered and not yet acknowledged", unacked)
        yield _g("queue_messages", "Ready plus unacknowledged messages", ready + unacked)
        yield _g("queue_messages_ready_bytes", "Body bytes of ready messages",
                 sum(q.store.bytes_ready for q in queues))
        yield _c("global_messages_received", "Messages published to the broker", stats.published)
        yield _c("global_messages_delivered", "Messages delivered to consumers or basic.get", stats.delivered)
        yield _c("global_messages_redelivered", "Messages delivered again after a requeue",
                 self.redelivered_total())
        yield _c("global_messages_acknowledged", "Messages acknowledged by consumers", stats.acked)
        yield _c("global_messages_confirmed", "Messages confirmed to publishers", stats.confirmed)
        yield _c("global_messages_unroutable_dropped", "Published messages that reached no queue",
                 stats.unroutable)
        yield _c("connections_opened", "Connections opened (AMQP, MQTT)", stats.connections_opened + opened)
        yield _c("connections_closed", "Connections closed (AMQP, MQTT)",
                 max(0, stats.connections_opened + opened - len(sessions) - others))
        alarm = broker.alarm
        yield _g("disk_space_available_limit_bytes", "Free disk space under which publishers are blocked",
                 alarm.disk.free_disk_min)
        yield _g("resident_memory_limit_bytes", "Memory high watermark (0: off)", alarm.memory.limit)
        for prefix in (PREFIX, RABBIT):  # RabbitMQ's alarm series, under both names
            yield GaugeMetricFamily(f"{prefix}_alarms_free_disk_space_watermark",
                                    "1 while the free disk space alarm is in effect",
                                    value=int(alarm.disk.active))
            yield GaugeMetricFamily(f"{prefix}_alarms_memory_used_watermark",
                                    "1 while the memory alarm is in effect", value=int(alarm.memory.active))
        yield _g("process_pid", "Process id", os.getpid())


def _rg(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{RABBIT}_{name}", doc, value=value)


def _rc(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{RABBIT}_{name}", doc, value=value)


class RabbitCollector(Collector):
    """The aggregated ``rabbitmq_*`` series of RabbitMQ's ``GET /metrics`` (one value per node)."""

    def __init__(self, mgmt: Source, redelivered: Callable[[], int]) -> None:
        self.mgmt = mgmt
        self.redelivered = redelivered

    def collect(self) -> Iterator[Metric]:
        broker = self.mgmt.broker
        st = broker.stats
        sessions = list(broker.connections)
        opened, others = _front_end_connections(self.mgmt)
        channels = [chs for s in sessions for chs in s.chs.values()]
        vhs = list(broker.vhosts.values())
        queues = [q for vh in vhs for q in vh.queues.values()]
        consumers = sum(len(q.consumers) for q in queues)
        yield _rg("connections", "Open connections", len(sessions) + others)
        yield _rc("connections_opened", "Connections opened", st.connections_opened + opened)
        yield _rc("connections_closed", "Connections closed",
                  max(0, st.connections_opened + opened - len(sessions) - others))
        yield _rg("channels", "Open channels", len(channels))
        yield _rc("channels_opened", "Channels opened", st.channels_opened)
        yield _rc("channels_closed", "Channels closed", max(0, st.channels_opened - len(channels)))
        yield _rg("channel_consumers", "Consumers on all channels", consumers)
        yield _rg("consumers", "Consumers", consumers)
        yield _rg("channel_messages_unacked", "Delivered, not yet acknowledged",
                  sum(chs.unacked_count for chs in channels))
        yield _rg("channel_messages_unconfirmed", "Published, not yet confirmed",
                  sum(chs.publish_seq - chs.confirmed for chs in channels if chs.confirm))
        yield _rg("channel_prefetch", "Prefetch limits of all channels",
                  sum(chs.prefetch for chs in channels))
        yield _rc("channel_messages_published", "Messages published", st.published)
        yield _rc("channel_messages_confirmed", "Publisher confirms sent", st.confirmed)
        yield _rc("channel_messages_unroutable_dropped", "Unroutable messages dropped",
                  max(0, st.unroutable - st.returned))
        yield _rc("channel_messages_unroutable_returned", "Unroutable messages returned", st.returned)
        yield _rc("channel_messages_delivered_ack", "Consumer deliveries in manual acknowledgement mode",
                  max(0, st.delivered - st.gets - st.delivered_autoack))
        yield _rc("channel_messages_delivered", "Consumer deliveries in automatic acknowledgement mode",
                  st.delivered_autoack)
        yield _rc("channel_messages_redelivered", "Messages delivered again", self.redelivered())
        yield _rc("channel_messages_acked", "Messages acknowledged", st.acked)
        yield _rc("channel_get_ack", "basic.get answered in manual acknowledgement mode",
                  st.gets - st.gets_autoack)
        yield _rc("channel_get", "basic.get answered in automatic acknowledgement mode", st.gets_autoack)
        yield _rc("channel_get_empty", "basic.get answered get-empty", st.gets_empty)
        yield _rg("queues", "Queues", len(queues))
        created = sum(vh.queues_created for vh in vhs)
        yield _rc("queues_declared", "Queues declared (created) since boot", created)
        yield _rc("queues_created", "Queues created since boot", created)
        yield _rc("queues_deleted", "Queues deleted since boot", sum(vh.queues_deleted for vh in vhs))
        yield _rc("queue_messages_published", "Messages routed to queues", sum(q.n_published for q in queues))
        ready = sum(q.message_count for q in queues)
        unacked = sum(q.store.unacked_count for q in queues)
        yield _rg("queue_messages_ready", "Ready messages", ready)
        yield _rg("queue_messages_unacked", "Unacknowledged messages", unacked)
        yield _rg("queue_messages", "Ready plus unacknowledged messages", ready + unacked)
        yield _rg("queue_messages_ready_bytes", "Body bytes of ready messages",
                  sum(q.store.bytes_ready for q in queues))
        yield _rg("queue_consumers", "Consumers on queues", consumers)
        yield _rg("erlang_uptime_seconds", "Seconds since the node started (no Erlang VM: the process)",
                  self.mgmt.uptime_seconds())


PROTOCOL = "amqp091"  # the label of RabbitMQ's per-protocol counters; Skred's management API counts in too


def _front_end_connections(mgmt: Source) -> tuple[int, int]:
    """(connections opened, connections open) of the front ends beside AMQP."""
    opened = sum(c.get("connections_opened", 0) for fe in mgmt.front_ends
                 for c in fe.protocol_counters().values())
    return opened, sum(len(fe.open_connections()) for fe in mgmt.front_ends)


def _by_protocol(mgmt: Source) -> dict[str, Mapping[str, int]]:
    """Each front end's counters by RabbitMQ's protocol label (``mqtt311``)."""
    return {label: c for fe in mgmt.front_ends for label, c in fe.protocol_counters().items()}
QUEUE_TYPE = "rabbit_classic_queue"  # deliveries are not counted per queue type: all are under this one


def _go_float(value: float) -> str:
    """A bucket bound as Prometheus (Go) writes ``le``: ``100.0``, ``1e+06``, ``+Inf``."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


class GlobalCollector(Collector):
    """RabbitMQ's ``rabbit_global_counters`` (``rabbitmq_global_*``, what its Overview dashboard
    reads) and ``rabbitmq_message_size_bytes``, from ``Broker.stats``, the open channels and
    the per-queue totals. Labels as RabbitMQ's: ``protocol``, and ``queue_type`` on the
    delivery-side counters."""

    def __init__(self, mgmt: Source, queue_totals: QueueTotals) -> None:
        self.mgmt = mgmt
        self.queue_totals = queue_totals

    def collect(self) -> Iterator[Metric]:
        broker = self.mgmt.broker
        st = broker.stats
        channels = [chs for s in list(broker.connections) for chs in s.chs.values()]
        per_queue = self.queue_totals.totals()
        protocol = (
            ("messages_received", "Messages received from publishers", st.published),
            ("messages_received_confirm", "Messages received from publishers expecting confirmations",
             st.received_confirm + sum(chs.publish_seq for chs in channels)),
            ("messages_routed", "Messages routed to queues (once per queue reached)",
             per_queue["n_published"]),
            ("messages_unroutable_dropped", "Messages published as non-mandatory and dropped as unroutable",
             max(0, st.unroutable - st.returned)),
            ("messages_unroutable_returned", "Messages published as mandatory and returned as unroutable",
             st.returned),
            ("messages_confirmed", "Messages confirmed to publishers", st.confirmed),
        )
        others = _by_protocol(self.mgmt)
        for name, doc, value in protocol:
            fam = CounterMetricFamily(f"{RABBIT}_global_{name}", doc, labels=["protocol"])
            fam.add_metric([PROTOCOL], value)
            for label, counters in others.items():
                if name in counters:
                    fam.add_metric([label], counters[name])
            yield fam
        for name, doc, value in (
                ("publishers", "Channels (MQTT: connections) that have published",
                 sum(1 for chs in channels if chs.publisher)),
                ("consumers", "Consumers on open channels and MQTT connections",
                 sum(len(chs.consumers) for chs in channels))):
            gauge = GaugeMetricFamily(f"{RABBIT}_global_{name}", doc, labels=["protocol"])
            gauge.add_metric([PROTOCOL], value)
            for label, counters in others.items():
                gauge.add_metric([label], counters.get(name, 0))
            yield gauge
        gets_manual = st.gets - st.gets_autoack
        by_queue_type = (
            ("messages_delivered", "Messages delivered to consumers (consume and get)", st.delivered),
            ("messages_delivered_consume_manual_ack", "Deliveries to consumers with manual acknowledgement",
             max(0, st.delivered - st.gets - st.delivered_autoack)),
            ("messages_delivered_consume_auto_ack", "Deliveries to consumers with automatic acknowledgement",
             st.delivered_autoack),
            ("messages_delivered_get_manual_ack", "basic.get deliveries with manual acknowledgement",
             gets_manual),
            ("messages_delivered_get_auto_ack", "basic.get deliveries with automatic acknowledgement",
             st.gets_autoack),
            ("messages_get_empty", "basic.get operations that fetched no message", st.gets_empty),
            ("messages_redelivered", "Messages delivered again", per_queue["n_redelivered"]),
            ("messages_acknowledged", "Messages acknowledged by consumers", st.acked),
        )
        for name, doc, value in by_queue_type:
            fam = CounterMetricFamily(f"{RABBIT}_global_{name}", doc, labels=["protocol", "queue_type"])
            fam.add_metric([PROTOCOL, QUEUE_TYPE], value)
            for label, counters in others.items():
                if name in counters:
                    fam.add_metric([label, QUEUE_TYPE], counters[name])
            yield fam
        sizes = HistogramMetricFamily(f"{RABBIT}_message_size_bytes",
                                      "Size of messages received from publishers", labels=["protocol"])
        sizes.add_metric([PROTOCOL], [(_go_float(le), n) for le, n in st.sizes.cumulative()], st.sizes.total)
        yield sizes


_PER_QUEUE: tuple[tuple[str, str, str, Callable[[Any], float]], ...] = (
    ("queue_messages_ready", "gauge", "Ready messages", lambda q: q.message_count),
    ("queue_messages_unacked", "gauge", "Unacknowledged messages", lambda q: q.store.unacked_count),
    ("queue_messages", "gauge", "Ready plus unacknowledged",
     lambda q: q.message_count + q.store.unacked_count),
    ("queue_messages_ready_bytes", "gauge", "Body bytes of ready messages", lambda q: q.store.bytes_ready),
    ("queue_consumers", "gauge", "Consumers", lambda q: len(q.consumers)),
    ("queue_paused", "gauge", "1 while the queue is paused (nothing delivered)", lambda q: int(q.paused)),
    ("queue_messages_published", "counter", "Messages routed to the queue", lambda q: q.n_published),
    ("queue_messages_delivered", "counter", "Deliveries (consume and get)", lambda q: q.n_delivered),
    ("queue_messages_acked", "counter", "Acknowledged", lambda q: q.n_acked),
    ("queue_messages_redelivered", "counter", "Redelivered", lambda q: q.n_redelivered),
)


def stream_consumer_lags(front_ends: Iterable[FrontEndView]) -> dict[tuple[str, str, str], int]:
    """The stream protocol's consumer lag per (vhost, stream, consumer), as Kafka's tools show a
    consumer group's lag per partition: a super stream's partitions are streams, and the consumer
    is the subscription's ``name`` (its offset-tracking reference; ``<connection>/<id>`` when it
    has none). Several subscriptions under one name (a single-active-consumer group): the largest."""
    from broker.views import StreamEntitiesView

    lags: dict[tuple[str, str, str], int] = {}
    for fe in front_ends:
        if isinstance(fe, StreamEntitiesView):
            for conn, info in fe.stream_consumers():
                who = info["properties"].get("name") or f"{conn.name}/{info['subscription_id']}"
                key = (conn.vhost, info["stream"], who)
                lags[key] = max(lags.get(key, 0), info["offset_lag"])
    return lags


class PerObjectCollector(Collector):
    """``/metrics/per-object``: RabbitMQ's per-queue series, labelled ``vhost`` and ``queue``,
    and the stream consumers' lag (``stream_consumer_lags``)."""

    def __init__(self, mgmt: Source) -> None:
        self.mgmt = mgmt

    def collect(self) -> Iterator[Metric]:
        queues = [q for _n, vh in sorted(self.mgmt.broker.vhosts.items()) for q in vh.queues.values()]
        for name, kind, doc, value in _PER_QUEUE:
            fam: GaugeMetricFamily | CounterMetricFamily
            if kind == "gauge":
                fam = GaugeMetricFamily(f"{RABBIT}_{name}", doc, labels=["vhost", "queue"])
            else:
                fam = CounterMetricFamily(f"{RABBIT}_{name}", doc, labels=["vhost", "queue"])
            for q in queues:
                fam.add_metric([q.vhost, q.name], value(q))
            yield fam
        lag = GaugeMetricFamily(f"{PREFIX}_stream_consumer_offset_lag",
                                "Messages stored in a stream past what its consumer was sent",
                                labels=["vhost", "stream", "consumer"])
        for labels, behind in sorted(stream_consumer_lags(self.mgmt.front_ends).items()):
            lag.add_metric(list(labels), behind)
        yield lag


class DetailedCollector(Collector):
    """Per-queue and per-vhost series for ``/metrics/detailed``."""

    def __init__(self, mgmt: Source, families: Sequence[str], vhosts: Sequence[str]) -> None:
        self.mgmt = mgmt
        self.families = families
        self.vhosts = vhosts

    def collect(self) -> Iterable[Metric]:
        broker = self.mgmt.broker
        vhs = [vh for name, vh in sorted(broker.vhosts.items()) if not self.vhosts or name in self.vhosts]
        out: list[Metric] = []
        for prefix in (PREFIX, RABBIT):
            out += self._families(vhs, f"{prefix}_detailed")
        return out

    def _families(self, vhs: list[Any], p: str) -> list[Metric]:
        labels = ["vhost", "queue"]
        out: list[Metric] = []
        if "queue_coarse_metrics" in self.families:
            ready = GaugeMetricFamily(f"{p}_queue_messages_ready", "Ready messages", labels=labels)
            unacked = GaugeMetricFamily(f"{p}_queue_messages_unacked", "Unacknowledged messages",
                                        labels=labels)
            total = GaugeMetricFamily(f"{p}_queue_messages", "Ready plus unacknowledged", labels=labels)
            for vh in vhs:
                for q in vh.queues.values():
                    ready.add_metric([vh.name, q.name], q.message_count)
                    unacked.add_metric([vh.name, q.name], q.store.unacked_count)
                    total.add_metric([vh.name, q.name], q.message_count + q.store.unacked_count)
            out += [ready, unacked, total]
        if "queue_consumer_count" in self.families:
            consumers = GaugeMetricFamily(f"{p}_queue_consumers", "Consumers", labels=labels)
            for vh in vhs:
                for q in vh.queues.values():
                    consumers.add_metric([vh.name, q.name], len(q.consumers))
            out.append(consumers)
        if "queue_delivery_metrics" in self.families:
            fams = {
                attr: CounterMetricFamily(f"{p}_queue_messages_{what}", doc, labels=labels)
                for attr, what, doc in (("n_published", "published", "Published"),
                                        ("n_delivered", "delivered", "Delivered"),
                                        ("n_acked", "acked", "Acknowledged"),
                                        ("n_redelivered", "redelivered", "Redelivered"))
            }
            for vh in vhs:
                for q in vh.queues.values():
                    for attr, fam in fams.items():
                        fam.add_metric([vh.name, q.name], getattr(q, attr))
            out += list(fams.values())
        if "vhost_status" in self.families:
            status = GaugeMetricFamily(f"{p}_vhost_status", "1 when the vhost is running", labels=["vhost"])
            for vh in vhs:
                status.add_metric([vh.name], 1)
            out.append(status)
        if "vhost_coarse_metrics" in self.families:
            vq = GaugeMetricFamily(f"{p}_vhost_queues", "Queues per vhost", labels=["vhost"])
            vm = GaugeMetricFamily(f"{p}_vhost_messages", "Ready plus unacknowledged messages per vhost",
                                   labels=["vhost"])
            for vh in vhs:
                vq.add_metric([vh.name], len(vh.queues))
                vm.add_metric([vh.name], sum(q.message_count + q.store.unacked_count
                                             for q in vh.queues.values()))
            out += [vq, vm]
        return out


class Metrics:
    def __init__(self, mgmt: Source) -> None:
        self.mgmt = mgmt
        self.registry = CollectorRegistry(auto_describe=False)
        skred = SkredCollector(mgmt)
        node = NodeCollector(mgmt.data_dir, lambda: (mgmt.node_name, mgmt.cluster_name),
                             lambda: mgmt.broker.alarm.disk.free_disk_min,
                             lambda: len(mgmt.connections()), lambda: mgmt.broker.alarm.memory.limit)
        self.registry.register(skred)
        self.registry.register(ClusterCollector(lambda: mgmt.cluster, lambda: mgmt.broker))
        self.registry.register(node)
        self.registry.register(RabbitCollector(mgmt, skred.redelivered_total))
        self.registry.register(GlobalCollector(mgmt, skred.queue_totals))
        identity = node.identity.identity
        self.per_object = CollectorRegistry(auto_describe=False)
        self.per_object.register(NodeCollector(mgmt.data_dir, identity, node.disk_limit, node.sockets,
                                               node.memory_limit, PER_OBJECT))
        self.per_object.register(PerObjectCollector(mgmt))
        self.detailed_identity = IdentityCollector(identity, DETAILED)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def render_per_object(self) -> bytes:
        return generate_latest(self.per_object)

    def render_detailed(self, families: Sequence[str], vhosts: Sequence[str]) -> bytes:
        """The requested families Skred serves (``DETAILED_FAMILIES``); any other requested
        family is left out, as RabbitMQ leaves out the ones it does not know, so one family
        Skred lacks never costs a scraper the rest."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(DetailedCollector(self.mgmt, [f for f in families if f in DETAILED_FAMILIES],
                                            vhosts))
        registry.register(self.detailed_identity)
        return generate_latest(registry)


class FollowerMetrics:
    """The cluster gauges on the metrics port while this node follows (no broker runs here)."""

    def __init__(self, view: ClusterInfo, data_dir: Path | None = None, cluster_name: str = "",
                 name: str = "", routes: Callable[[web.Application], None] | None = None) -> None:
        # with data_dir: this node's own process/disk metrics, labelled with the cluster's and
        # this node's names
        self.registry = cluster_registry(view, data_dir, cluster_name, name)
        self._runner: web.AppRunner | None = None
        self.routes = routes  # more of the follower's own (skredctl stop_app: http/routes_app.py)

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self, bind: str, port: int) -> None:
        from aiohttp import web
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        if self.routes is not None:
            self.routes(app)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, bind, port, reuse_address=True).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("follower metrics listening on %s:%d", bind, port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE})
