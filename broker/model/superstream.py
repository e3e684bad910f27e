"""Super streams: a direct exchange bound to partition streams, RabbitMQ's topology.

Theory of operation
-------------------
A super stream ``S`` is a durable direct exchange ``S`` with the argument ``x-super-stream:
true``, bound to durable stream queues (its partitions), each binding carrying the argument
``x-stream-partition-order`` (0, 1, ...). With ``partitions=N`` the partitions are ``S-0`` ..
``S-N-1`` bound with the routing keys ``"0"`` .. ``"N-1"``; with binding keys ``a,b,c`` they
are ``S-a``, ``S-b``, ``S-c`` bound with those keys. That is exactly what RabbitMQ's
``rabbitmq-streams add_super_stream`` and the stream protocol's CreateSuperStream build, so
its clients (rstream, the Java and Go stream clients) and tools recognise one of ours.

Everything here goes through the vhost's public operations (declare, bind, delete), so it is
logged in the definitions like any declare, replicated, and replayed at boot. ``create``
validates every name before it declares anything and undoes what it declared when a step
fails, so an error means nothing was created. ``grow`` adds partitions after the highest
order (existing ones keep their data and order); routing by key is unaffected, routing by
hash (``partition_for_key``) maps keys anew, like any change of partition count in Kafka.

``partition_for_key`` is the Java and Go stream clients' hash routing strategy: MurmurHash3
x86_32 with seed 104729 (``broker/model/murmur3.py``), unsigned, modulo the partition count.
A super stream declared with ``x-super-stream-routing: hash`` applies it to AMQP publishes
(``broker/model/exchange_features.py``), so a publisher needs no knowledge of partitions.
rstream 1.1.1 hashes with MurmurHash3 x64_128 instead (its 128-bit value, little-endian, modulo
the count), so its producers place keys differently: docs/compatibility.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from broker import errors
from broker.model import exchange_features
from broker.model.murmur3 import murmur3_32
from broker.model.stream import StreamQueue
from broker.model.vhost import VHost

SUPER_STREAM_ARG: Final = "x-super-stream"
PARTITION_ORDER_ARG: Final = exchange_features.PARTITION_ORDER
ROUTING_ARG: Final = exchange_features.PARTITION_ROUTING  # "hash": AMQP publishes go by hash of the key
MAX_PARTITIONS: Final = 1024  # bound on one declare's work (queues, bindings, definitions log)
_STREAM_ARGS: Final = {"x-queue-type": "stream"}


def is_super_stream(vh: VHost, name: str) -> bool:
    ex = vh.exchanges.get(name)
    return ex is not None and _truthy(ex.arguments.get(SUPER_STREAM_ARG))


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, (str, bytes)) and str(value if isinstance(value, str)
                                                                   else value.decode()).lower() == "true")


def layout(name: str, partitions: int = 0, binding_keys: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``[(partition stream, binding key)]`` in partition order; ValueError when unusable."""
    if bool(partitions) == bool(binding_keys):
        raise ValueError("give either a partition count or binding keys")
    keys = list(binding_keys) if binding_keys else [str(i) for i in range(partitions)]
    if not 0 < len(keys) <= MAX_PARTITIONS:
        raise ValueError(f"a super stream has 1 to {MAX_PARTITIONS} partitions")
    if len(set(keys)) != len(keys) or any(not k for k in keys):
        raise ValueError("binding keys must be distinct and not empty")
    out = [(f"{name}-{k}", k) for k in keys]
    if any(len(s.encode()) > 255 for s, _ in out) or not name:
        raise ValueError("super stream and partition names are at most 255 bytes, and not empty")
    return out


def partitions(vh: VHost, name: str) -> list[str]:
    """The partition streams of super stream ``name`` in partition order; NotFound if none."""
    return [q for q, _ in bindings(vh, name)]


def bindings(vh: VHost, name: str) -> list[tuple[str, str]]:
    """``[(partition stream, binding key)]`` of super stream ``name`` in partition order."""
    if not is_super_stream(vh, name):
        raise errors.NotFound(f"no super stream '{name}' in vhost '{vh.name}'")
    found: list[tuple[int, str, str]] = []
    for dest, key, args in vh.exchanges[name].bindings():
        if isinstance(dest, StreamQueue):
            order = args.get(PARTITION_ORDER_ARG)
            found.append((order if isinstance(order, int) else MAX_PARTITIONS, dest.name, key))
    found.sort()
    return [(q, k) for _, q, k in found]


def route(vh: VHost, name: str, routing_key: str) -> list[str]:
    """The partitions a message with ``routing_key`` goes to (the direct exchange's rule)."""
    return [q for q, k in bindings(vh, name) if k == routing_key]


def create(vh: VHost, name: str, partitions: int = 0, binding_keys: Sequence[str] = (),
           arguments: dict[str, Any] | None = None, routing: str = "key") -> list[str]:
    """Declare super stream ``name`` (exchange, partition streams, bindings); its partitions.

    ``arguments`` are the partitions' stream arguments (retention, segment size); ``routing``
    "hash" makes AMQP publishers' messages go by hash of their routing key (``ROUTING_ARG``).
    An error leaves nothing behind; an identical super stream already there is fine."""
    if routing not in ("key", "hash"):
        raise ValueError("routing is 'key' or 'hash'")
    plan = layout(name, partitions, binding_keys)
    ex = vh.exchanges.get(name)
    if ex is not None and not is_super_stream(vh, name):
        raise errors.PreconditionFailed(f"exchange '{name}' in vhost '{vh.name}' exists and is not a "
                                        "super stream")
    if ex is not None:
        if bindings(vh, name) != plan:
            raise errors.PreconditionFailed(f"super stream '{name}' in vhost '{vh.name}' exists with "
                                            "other partitions")
        return [q for q, _ in plan]
    for q, _ in plan:
        if q in vh.queues:
            raise errors.PreconditionFailed(f"queue '{q}' in vhost '{vh.name}' already exists")
    args = dict(arguments or {})
    args.update(_STREAM_ARGS)
    made: list[str] = []
    try:
        ex_args: dict[str, Any] = {SUPER_STREAM_ARG: True}
        if routing == "hash":
            ex_args[ROUTING_ARG] = "hash"
        vh.declare_exchange(name, "direct", durable=True, arguments=ex_args)
        _add(vh, name, plan, 0, args, made)
    except BaseException:
        for q in made:
            vh.delete_queue(q, owner=None)
        if name in vh.exchanges:
            vh.delete_exchange(name)
        raise
    return [q for q, _ in plan]


def _add(vh: VHost, name: str, plan: list[tuple[str, str]], first_order: int, args: dict[str, Any],
         made: list[str]) -> None:
    for i, (q, key) in enumerate(plan):
        vh.declare_queue(q, durable=True, arguments=args, owner=None)
        made.append(q)
        vh.bind_queue(q, name, key, {PARTITION_ORDER_ARG: first_order + i}, owner=None)


def grow(vh: VHost, name: str, partitions: int = 0, binding_keys: Sequence[str] = (),
         arguments: dict[str, Any] | None = None) -> list[str]:
    """Add partitions after the existing ones: ``partitions`` is the new total count (numbered
    partitions), ``binding_keys`` the keys to add. Returns the new partitions."""
    old = bindings(vh, name)
    if partitions:
        if partitions <= len(old):
            raise errors.PreconditionFailed(f"super stream '{name}' has {len(old)} partitions already")
        plan = layout(name, partitions)[len(old):]
    else:
        plan = layout(name, 0, binding_keys)
    taken = {k for _, k in old}
    if len(old) + len(plan) > MAX_PARTITIONS or any(k in taken or q in vh.queues for q, k in plan):
        raise errors.PreconditionFailed(f"super stream '{name}': partitions exist or too many")
    args = dict(arguments or {})
    args.update(_STREAM_ARGS)
    made: list[str] = []
    try:
        _add(vh, name, plan, len(old), args, made)
    except BaseException:
        for q in made:
            vh.delete_queue(q, owner=None)
        raise
    return [q for q, _ in plan]


def delete(vh: VHost, name: str) -> list[str]:
    """Delete the super stream and every partition stream; the partitions deleted."""
    parts = partitions(vh, name)
    vh.delete_exchange(name)
    for q in parts:
        vh.delete_queue(q, owner=None)
    return parts


def partition_for_key(routing_key: str, count: int) -> int:
    """The partition index the stream clients' hash routing picks for ``routing_key``."""
    return murmur3_32(routing_key.encode()) % count
