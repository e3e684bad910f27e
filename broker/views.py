"""What the management API and the metrics read of the running broker, as protocols.

The node hands ``Mgmt`` the live broker object of the AMQP front end; the management
API only reads and counts through the members below, so it never imports ``net`` (the
layer rule: front ends are siblings). Any other protocol front end (MQTT) whose connections
should show in ``/api/connections`` and the metrics is a ``FrontEndView`` the node adds to
``Mgmt.front_ends``: its connections are ``ConnectionView``s like AMQP's (no channels), its
counters are RabbitMQ's per-protocol ones. Read-only members are properties, so the
implementing classes may use narrower types (a ``dict`` of their own channel class).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sized
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from broker.auth.users import UserStore
from broker.errors import AMQPError
from broker.model.queue import Queue
from broker.model.vhost import VHost

if TYPE_CHECKING:
    from broker.tls import PeerTLS


class ConsumerView(Protocol):
    @property
    def tag(self) -> str: ...
    @property
    def queue(self) -> Queue: ...
    @property
    def no_ack(self) -> bool: ...
    @property
    def exclusive(self) -> bool: ...
    @property
    def prefetch(self) -> int: ...
    @property
    def arguments(self) -> dict[str, Any]: ...


class ChannelView(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def flow(self) -> bool: ...
    @property
    def consumers(self) -> Mapping[str, ConsumerView]: ...
    @property
    def unacked(self) -> Sized: ...
    @property
    def unacked_count(self) -> int: ...
    @property
    def confirm(self) -> bool: ...
    @property
    def publish_seq(self) -> int: ...
    @property
    def confirmed(self) -> int: ...
    @property
    def tx(self) -> list[tuple[Any, ...]] | None: ...
    @property
    def prefetch(self) -> int: ...
    @property
    def global_prefetch(self) -> int: ...
    # the channel's own counters (its rates and history): publishes, delivery tags handed out
    # (deliveries and gets: ``next_tag - 1``), acks; its confirms are ``confirmed``
    @property
    def n_published(self) -> int: ...
    @property
    def next_tag(self) -> int: ...
    @property
    def n_acked(self) -> int: ...
    # of the delivery tags: basic.gets with and without acks, no-ack deliveries; and every
    # delivery or get flagged redelivered (RabbitMQ's ``message_stats`` split of ``deliver_get``)
    @property
    def n_get(self) -> int: ...
    @property
    def n_get_no_ack(self) -> int: ...
    @property
    def n_deliver_no_ack(self) -> int: ...
    @property
    def n_redelivered(self) -> int: ...
    @property
    def publisher(self) -> bool:
        """Whether the channel has published (RabbitMQ's publishers gauge counts these)."""


class ConnectionView(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def protocol(self) -> str:
        """As RabbitMQ's API shows it: ``AMQP 0-9-1``, ``MQTT 3.1.1``, ``MQTT 5.0``."""
    @property
    def listener(self) -> str:
        """The listener it came in on, by RabbitMQ's protocol name (``amqp``, ``amqp/ssl``,
        ``mqtt``, ``mqtt/ssl``, ``http``: WebSocket on the management port)."""
    @property
    def vhost(self) -> str: ...
    @property
    def username(self) -> str: ...
    @property
    def peer(self) -> tuple[Any, ...]: ...
    @property
    def chs(self) -> Mapping[int, ChannelView]: ...
    @property
    def channel_max(self) -> int: ...
    @property
    def frame_max(self) -> int: ...
    @property
    def heartbeat(self) -> int: ...
    @property
    def connected_at(self) -> float: ...
    @property
    def recv_cnt(self) -> int: ...
    @property
    def recv_oct(self) -> int: ...
    @property
    def send_cnt(self) -> int: ...
    @property
    def send_oct(self) -> int: ...
    @property
    def client_properties(self) -> dict[str, Any]: ...
    @property
    def auth_mechanism(self) -> str: ...
    @property
    def tls(self) -> PeerTLS | None:
        """The TLS session of the connection (None for plain AMQP)."""

    def close_connection(self, error: AMQPError) -> None: ...

    def wakeup(self) -> None: ...


# RabbitMQ's per-protocol global counters a front end keeps (``rabbitmq_global_<name>``), and
# the connections it opened (for ``connections_opened``/``closed``)
FRONT_END_COUNTERS = ("messages_received", "messages_received_confirm", "messages_confirmed",
                      "messages_delivered", "messages_delivered_consume_auto_ack",
                      "messages_delivered_consume_manual_ack", "messages_acknowledged", "connections_opened")
FRONT_END_GAUGES = ("publishers", "consumers")


@runtime_checkable
class FrontEndView(Protocol):
    """A protocol front end beside AMQP, as the management API and the metrics see it."""

    def open_connections(self) -> Collection[ConnectionView]:
        """Its connections past their login."""

    def protocol_counters(self) -> Mapping[str, Mapping[str, int]]:
        """Per RabbitMQ protocol label (``mqtt311``): ``FRONT_END_COUNTERS`` and
        ``FRONT_END_GAUGES`` by name."""

    def consumers(self) -> Iterable[tuple[ConnectionView, ConsumerView]]:
        """Its connections' consumers; they have no channel (the API shows channel number 0)."""

    def close_vhost_clients(self, vhost: str, reason: str) -> int:
        """``vhost`` is no longer served here (``Node.close_shard``): close its connections at
        once with the protocol's "go elsewhere" close, so nothing they send after is answered
        here; how many were closed."""


# One session as a list finds it before rendering it: (vhost, client id, connected, user: who
# logged it in, or for an away session its pending will's user). What the list filters and sorts
# on without building the session's JSON; a plain tuple, made 10,000 times per list request.
SessionEntry = tuple[str, str, bool, str]


@runtime_checkable
class StreamEntitiesView(Protocol):
    """The stream protocol's publishers and subscriptions with the connection each belongs to,
    as JSON-ready dicts naming their stream (``/api/stream/publishers`` and ``/consumers``);
    a front end that offers them is the stream protocol's (``/api/stream/connections``)."""

    def stream_publishers(self) -> Iterable[tuple[ConnectionView, dict[str, Any]]]: ...

    def stream_consumers(self) -> Iterable[tuple[ConnectionView, dict[str, Any]]]: ...


@runtime_checkable
class SessionsView(Protocol):
    """A front end with sessions of its own beyond its connections (MQTT's, which outlive them):
    ``/api/mqtt/sessions`` and the UI's MQTT pages find them as ``SessionEntry``s and render the
    ones a page shows as plain JSON-ready dicts, so a page of 10,000 sessions renders its own."""

    def session_entries(self, vhost: str | None = None) -> list[SessionEntry]: ...

    def session(self, vhost: str, client_id: str) -> dict[str, Any] | None: ...


class SizesView(Protocol):
    """Body sizes of published messages (``broker.amqp.sizes.MessageSizes``)."""

    total: int

    def observe(self, size: int) -> None: ...

    def cumulative(self) -> list[tuple[float, int]]: ...


class StatsView(Protocol):
    """Global counters; the HTTP publish and get count themselves in."""

    published: int
    delivered: int
    acked: int
    confirmed: int
    unroutable: int
    connections_opened: int
    returned: int
    gets: int
    gets_empty: int
    channels_opened: int
    delivered_autoack: int  # of ``delivered``: without acknowledgement
    gets_autoack: int  # of ``gets``: without acknowledgement
    received_confirm: int  # publishes on confirm-mode channels that have closed since
    @property
    def sizes(self) -> SizesView: ...


class DiskAlarmView(Protocol):
    free_disk_min: int  # settable: PUT /api/node/disk-limit

    @property
    def active(self) -> bool: ...

    def free(self) -> int: ...


class MemoryAlarmView(Protocol):
    @property
    def limit(self) -> int: ...
    @property
    def active(self) -> bool: ...


class AlarmView(Protocol):
    @property
    def disk(self) -> DiskAlarmView: ...
    @property
    def memory(self) -> MemoryAlarmView: ...
    @property
    def active(self) -> bool: ...

    def resources(self) -> list[str]: ...

    def disk_full(self, need: int, sessions: Any) -> None:
        """A write found the disk full: raise the disk alarm at once (``sessions``: the
        broker's ``connections``, which the alarm blocks)."""


class SyncerView(Protocol):
    def discard(self, obj: Any) -> None: ...

    def after_sync(self, callback: Callable[[bool], None]) -> None: ...


class BrokerView(Protocol):
    @property
    def vhosts(self) -> dict[str, VHost]: ...
    @property
    def users(self) -> UserStore: ...
    @property
    def stats(self) -> StatsView: ...
    @property
    def connections(self) -> Collection[ConnectionView]: ...
    @property
    def alarm(self) -> AlarmView: ...
    @property
    def syncer(self) -> SyncerView: ...
