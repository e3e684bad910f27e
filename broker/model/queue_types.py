"""Queue types as RabbitMQ 4 declares them: ``classic``, ``quorum``, ``stream``.

Theory of operation
-------------------
A queue's type is its ``x-queue-type`` argument, checked and completed once at declare time by
``resolve``; everything after that reads ``type_of(q.arguments)``. There is one queue engine: a
type chooses checks and defaults at declare time and the queue's class (``StreamQueue``,
``QuorumQueue``: broker/model/queue_featured.py), which shares delivery and settlement.

- Unknown types are refused with 406 PRECONDITION_FAILED (AMQP and the HTTP API alike).
- Without ``x-queue-type``, a durable, non-exclusive queue gets its vhost's
  ``default_queue_type`` written into its arguments, as RabbitMQ 3.13+/4 does, so a redeclare,
  a definitions export and a restart all see the same type. Exclusive or transient queues stay
  classic (RabbitMQ 4 falls back the same way).
- Quorum and stream queues are durable, never exclusive, never auto-delete: 406 otherwise, with
  RabbitMQ's ``invalid property`` texts. Quorum queues refuse ``x-max-priority`` (406) and a
  consumer on a channel with a global prefetch (540, ``check_consume``, asked by
  ``QuorumQueue.check_consume``), as RabbitMQ does.
- Quorum queues: two message-priority levels, always on (``QuorumPriorityStore``, chosen at
  declare by the vhost); a delivery limit of 20 unless the queue or a policy sets one (RabbitMQ 4.0);
  ``x-delivery-count`` is carried on redeliveries by the features layer; ``x-dead-letter-strategy``
  accepts ``at-most-once`` and ``at-least-once``.
"""

from __future__ import annotations

from typing import Any

from broker import errors

CLASSIC, QUORUM, STREAM = "classic", "quorum", "stream"
TYPES = (CLASSIC, QUORUM, STREAM)
QUORUM_DELIVERY_LIMIT = 20  # RabbitMQ 4.0's default for quorum queues
DEAD_LETTER_STRATEGIES = ("at-most-once", "at-least-once")


def type_of(arguments: dict[str, Any] | None) -> str:
    value = (arguments or {}).get("x-queue-type") or CLASSIC
    return value.decode() if isinstance(value, bytes) else str(value)


def check_type(qtype: Any, queue: str, vhost: str) -> str:
    if isinstance(qtype, bytes):
        qtype = qtype.decode(errors="replace")
    if qtype not in TYPES:
        raise errors.PreconditionFailed(
            f"invalid arg 'x-queue-type' for queue '{queue}' in vhost '{vhost}': "
            f"\"unsupported queue type '{qtype}'\"", 50, 10)
    return str(qtype)


def with_default(arguments: dict[str, Any], *, durable: bool, exclusive: bool,
                 default_type: str) -> dict[str, Any]:
    """``arguments`` with the vhost's default type filled in where RabbitMQ 4 fills it in."""
    if "x-queue-type" in arguments or default_type == CLASSIC or exclusive or not durable:
        return arguments
    return {**arguments, "x-queue-type": default_type}


def resolve(arguments: dict[str, Any], *, durable: bool, exclusive: bool, auto_delete: bool,
            queue: str, vhost: str) -> dict[str, Any]:
    """Check a new queue's type against its properties and arguments; 406 when it refuses them."""
    if "x-queue-type" not in arguments:
        return arguments
    qtype = check_type(arguments["x-queue-type"], queue, vhost)
    if qtype == CLASSIC:
        return arguments
    if arguments["x-queue-type"] != qtype:
        arguments = {**arguments, "x-queue-type": qtype}  # bytes from a field table: one spelling
    for bad, prop in ((exclusive, "exclusive-owner"), (not durable, "non-durable"),
                      (auto_delete, "auto-delete")):
        if bad:
            raise errors.PreconditionFailed(
                f"invalid property '{prop}' for queue '{queue}' in vhost '{vhost}'", 50, 10)
    if qtype == QUORUM and "x-max-priority" in arguments:
        raise errors.PreconditionFailed(
            f"invalid arg 'x-max-priority' for queue '{queue}' in vhost '{vhost}' "
            "of queue type rabbit_quorum_queue", 50, 10)
    strategy = arguments.get("x-dead-letter-strategy")
    if strategy is not None:
        text = strategy.decode(errors="replace") if isinstance(strategy, bytes) else strategy
        if qtype == QUORUM and text not in DEAD_LETTER_STRATEGIES:  # other types ignore it
            raise errors.PreconditionFailed(
                f"invalid arg 'x-dead-letter-strategy' for queue '{queue}' in vhost '{vhost}': "
                "invalid_dlx_strategy", 50, 10)
    return arguments


def check_consume(arguments: dict[str, Any], global_prefetch: int, queue: str, vhost: str) -> None:
    """RabbitMQ: a quorum queue refuses a consumer on a channel with a global prefetch (540)."""
    if global_prefetch and type_of(arguments) == QUORUM:
        raise errors.AMQPNotImplemented(f"queue '{queue}' in vhost '{vhost}' does not support global qos",
                                        60, 20)


def default_delivery_limit(arguments: dict[str, Any]) -> int | None:
    """The delivery limit a queue of this type has when neither argument nor policy sets one."""
    return QUORUM_DELIVERY_LIMIT if type_of(arguments) == QUORUM else None
