"""What the publish operation takes and returns, and the interface below it that reaches it.

The operation itself (``broker/model/publish.py``) sits above the queue engine and the
exchanges it routes through; its request and outcome are plain data, kept down here so that
what lies under it can build and read them. Dead-lettering (``broker/model/deadletter.py``,
from a queue's features) and delayed firing (``broker/model/exchange_features.py``, from an
exchange's hold) publish again from below: they reach the operation only through a
``Republisher`` the vhost hands them when it builds the queue or exchange, never by importing
it (the vhost implements it; ``VHost.publish`` is the same operation every front end calls).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from broker.model.queue import Queue
from broker.store.segment import short_pair


class EncodedNames(Protocol):
    """An exchange and routing key in the encodings the store and deliveries use."""

    exchange_b: bytes
    routing_key_b: bytes
    exrk: bytes  # both as AMQP short strings, as a stored record and basic.deliver carry them


class KeyedNames(EncodedNames, Protocol):
    """``EncodedNames`` with the routing key as a string (what routes)."""

    routing_key: str


class Names:
    """``EncodedNames`` from the two strings."""

    __slots__ = ("exchange_b", "routing_key_b", "exrk")

    def __init__(self, exchange: str, routing_key: str) -> None:
        self.exchange_b = exchange.encode()
        self.routing_key_b = routing_key.encode()
        self.exrk = short_pair(self.exchange_b, self.routing_key_b)


class Origin:
    """Who published a message (a client's connection and channel, on this node): what a
    firehose trace copy's headers name (``broker/model/trace.py``). A front end hands one in
    with every publish of a client; the broker's own publishes (dead-lettering, delayed firing,
    wills, the trace copies themselves) carry none and are never traced."""

    __slots__ = ("node", "user", "connection", "channel")

    def __init__(self, node: str, user: str, connection: str, channel: int) -> None:
        self.node = node
        self.user = user
        self.connection = connection
        self.channel = channel


class PublishRequest:
    """One message to publish, protocol-neutral.

    ``props``: the AMQP content-header property bytes (flags first), the store's format for
    every protocol. ``ts``: arrival time in ms. ``persistent``: None to read delivery-mode
    from ``props``. ``names``: the exchange and routing key already encoded, when the
    caller has them (an AMQP session keeps them per publish method frame). ``exclude``:
    queues the message must not reach (dead-lettering's cycle rule). ``cc``: False to route
    by ``routing_key`` alone, ignoring CC/BCC headers (dead-lettering with a dead-letter
    routing key). ``origin``: the client that published it, for firehose tracing (None: the
    broker itself, never traced).
    """

    __slots__ = ("exchange", "routing_key", "props", "body", "ts", "persistent", "names", "exclude", "cc",
                 "origin")

    def __init__(self, exchange: str, routing_key: str, props: bytes, body: bytes | memoryview, ts: int,
                 persistent: bool | None = None, names: EncodedNames | None = None,
                 exclude: Callable[[Queue], bool] | None = None, cc: bool = True,
                 origin: Origin | None = None) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.props = props
        self.body = body
        self.ts = ts
        self.persistent = persistent
        self.names = names
        self.exclude = exclude
        self.cc = cc
        self.origin = origin


class Forgets(Protocol):
    """A deduplicating exchange's cache (``dedup_cache.DedupCache``), as the publish
    operation undoes what it remembered of messages it then could not store."""

    def forget(self, props: list[bytes]) -> None: ...


class PublishOutcome:
    """What happened to one published message (or to every message of a run).

    ``queues``: the queues that took it (or refused it, see ``rejected``); ``rejected``: a
    queue refused it (length limit with reject-publish); ``held``: an exchange kept it for
    later (delayed) or dropped it as a duplicate: accepted, not unroutable; ``sync``: it
    reached durable storage, so a confirm waits for the group commit.
    """

    __slots__ = ("queues", "rejected", "held", "sync", "remembered")

    def __init__(self, queues: list[Queue], rejected: bool = False, held: bool = False,
                 sync: bool = False) -> None:
        self.queues = queues
        self.rejected = rejected
        self.held = held
        self.sync = sync
        # the deduplicating exchanges on the route that took its key as new (forgotten again
        # if it is then not stored): the publish operation's own bookkeeping
        self.remembered: list[Forgets] | None = None

    @property
    def unroutable(self) -> bool:
        return not self.queues and not self.held

    def __repr__(self) -> str:
        return (f"PublishOutcome(queues={[q.name for q in self.queues]}, rejected={self.rejected}, "
                f"held={self.held}, sync={self.sync})")


class BatchOutcome:
    """What ``publish_batch`` did: it published messages ``first`` to ``done - 1``;
    ``queues``: the queues they reached; ``unroutable``: the indices of those that reached
    none; ``sync``: a persistent one reached a durable queue (a confirm waits for the
    group commit)."""

    __slots__ = ("done", "queues", "unroutable", "sync")

    def __init__(self, done: int) -> None:
        self.done = done
        self.queues: list[Queue] = []
        self.unroutable: list[int] = []
        self.sync = False


class Republisher(Protocol):
    """The publish operation as dead-lettering and delayed firing reach it (the vhost)."""

    @property
    def exchanges(self) -> Mapping[str, object]:
        """The vhost's exchanges by name: a dead letter to a missing exchange is dropped, a
        delayed message whose exchange was deleted (or declared anew) is not routed."""

    def publish(self, req: PublishRequest) -> PublishOutcome:
        """The publish operation (``VHost.publish``)."""

    def publish_from_hold(self, req: PublishRequest) -> PublishOutcome:
        """The publish operation for a message coming out of its exchange's own hold (a
        delayed message now due): that first exchange's behaviour is not applied again."""
