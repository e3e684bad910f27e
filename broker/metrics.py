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
follower runs no broker, so the runner serves ``cluster_registry(view)`` on the
metrics port itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from broker import __version__

if TYPE_CHECKING:
    from broker.http.state import Mgmt

PREFIX = "skred"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DETAILED_FAMILIES = ("queue_coarse_metrics", "queue_consumer_count", "queue_delivery_metrics",
                     "vhost_status", "vhost_coarse_metrics")


def _g(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _c(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ClusterInfo(Protocol):
    """What a cluster member tells metrics and ``GET /api/cluster`` (see broker.cluster.status)."""

    def is_leader(self) -> bool: ...

    def follower_lags(self) -> dict[str, int]: ...

    def status(self) -> dict[str, Any]: ...


class ClusterCollector(Collector):
    """Cluster gauges, read from ``source()`` at scrape time; nothing when it returns None."""

    def __init__(self, source: Callable[[], ClusterInfo | None]) -> None:
        self.source = source

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


def cluster_registry(info: ClusterInfo) -> CollectorRegistry:
    """A registry with only the cluster gauges (a follower's metrics port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(lambda: info))
    return registry


class SkredCollector(Collector):
    def __init__(self, mgmt: Mgmt) -> None:
        self.mgmt = mgmt
        self._seen_redelivered: dict[int, int] = {}
        self._retired_redelivered = 0

    def _redelivered_total(self) -> int:
        current: dict[int, int] = {}
        for vh in self.mgmt.broker.vhosts.values():
            for q in vh.queues.values():
                current[id(q)] = q.n_redelivered
        for key, value in self._seen_redelivered.items():
            if key not in current:
                self._retired_redelivered += value
        self._seen_redelivered = current
        return self._retired_redelivered + sum(current.values())

    def collect(self) -> Iterator[Metric]:
        mgmt = self.mgmt
        broker = mgmt.broker
        stats = broker.stats
        sessions = [s for s in broker.connections]
        queues = [q for vh in broker.vhosts.values() for q in vh.queues.values()]
        ready = sum(q.message_count for q in queues)
        unacked = sum(q.store.unacked_count for q in queues)
        info = InfoMetricFamily(f"{PREFIX}_identity", "Node identity", labels=["node", "cluster", "version"])
        info.add_metric([mgmt.node_name, mgmt.cluster_name, __version__], {})
        yield info
        yield _g("uptime_seconds", "Seconds since the node started", mgmt.uptime_seconds())
        yield _g("connections", "Open AMQP connections", len(sessions))
        yield _g("channels", "Open AMQP channels", sum(len(s.chs) for s in sessions))
        yield _g("consumers", "Consumers on all queues", sum(len(q.consumers) for q in queues))
        yield _g("queues", "Queues in all vhosts", len(queues))
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
                 self._redelivered_total())
        yield _c("global_messages_acknowledged", "Messages acknowledged by consumers", stats.acked)
        yield _c("global_messages_confirmed", "Messages confirmed to publishers", stats.confirmed)
        yield _c("global_messages_unroutable_dropped", "Published messages that reached no queue",
                 stats.unroutable)
        yield _c("connections_opened", "AMQP connections opened", stats.connections_opened)
        yield _c("connections_closed", "AMQP connections closed",
                 max(0, stats.connections_opened - len(sessions)))
        yield _g("process_resident_memory_bytes", "Resident memory of the broker process",
                 mgmt.resident_memory())
        yield _g("process_open_fds", "Open file descriptors", mgmt.open_fds())
        yield _g("process_max_fds", "File descriptor limit", mgmt.max_fds())
        yield _g("disk_space_available_bytes", "Free bytes on the data directory's file system",
                 mgmt.disk_free())
        yield _g("process_pid", "Process id", os.getpid())


class DetailedCollector(Collector):
    """Per-queue and per-vhost series for ``/metrics/detailed``."""

    def __init__(self, mgmt: Mgmt, families: Sequence[str], vhosts: Sequence[str]) -> None:
        self.mgmt = mgmt
        self.families = families
        self.vhosts = vhosts

    def collect(self) -> Iterable[Metric]:
        broker = self.mgmt.broker
        vhs = [vh for name, vh in sorted(broker.vhosts.items()) if not self.vhosts or name in self.vhosts]
        labels = ["vhost", "queue"]
        p = f"{PREFIX}_detailed"
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
    def __init__(self, mgmt: Mgmt) -> None:
        self.mgmt = mgmt
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SkredCollector(mgmt))
        self.registry.register(ClusterCollector(lambda: mgmt.cluster))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def render_detailed(self, families: Sequence[str], vhosts: Sequence[str]) -> bytes:
        unknown = [f for f in families if f not in DETAILED_FAMILIES]
        if unknown:
            raise ValueError(f"unknown metric families: {', '.join(unknown)} "
                             f"(known: {', '.join(DETAILED_FAMILIES)})")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(DetailedCollector(self.mgmt, families, vhosts))
        return generate_latest(registry)
