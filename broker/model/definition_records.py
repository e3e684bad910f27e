"""Reading the records of a vhost's definitions log (``store/definitions.py``) at boot.

Each record is one AMQP method frame on channel 0 as pamqp encodes it: frame type (1),
channel, size, class and method ids, the method's arguments, frame end (0xCE). Boot
replays one record per durable queue and binding; pamqp's generic decoder (a loop over
the method's fields, one lookup and slice per field) cost about a third of the start of a
node with 50,000 queues. The two records such a log is made of, ``queue.declare`` and
``queue.bind`` with an empty argument table, are read here field by field (``plain``: a
tuple of the fields, which the vhost's replay takes without any method object built, issue
28; ``decode``: the same pamqp objects pamqp's ``unmarshal`` makes, defaults first, then
the fields), with no validation: a name stored once is replayed as it is. Anything else,
and any record these readers do not take exactly to its end, goes to pamqp. The unit
tests compare both readers on the same records, and on damaged ones.
"""

from __future__ import annotations

import struct
from typing import Final

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame as PFrame

_HEAD: Final = struct.Struct(">BHIHHH")  # frame type, channel, size, class, method, ticket
_FRAME_METHOD: Final = 1
_FRAME_END: Final = 0xCE
_QUEUE: Final = 50
_DECLARE: Final = 10
_BIND: Final = 20
_NO_ARGUMENTS: Final = b"\0\0\0\0"  # an empty field table


def decode(record: bytes) -> PFrame | None:
    """The method a record holds (None for a frame that is not a method);
    raises ``pamqp.exceptions.UnmarshalingException`` for a malformed one, as pamqp does."""
    method = _plain_queue_record(record)
    if method is not None:
        return method
    _, _, decoded = pframe.unmarshal(record)
    return decoded if isinstance(decoded, PFrame) else None


# A plain record read without pamqp: (class-method, queue, exchange, routing key, bits).
# ``QUEUE_DECLARE``'s bits are passive 1, durable 2, exclusive 4, auto-delete 8, nowait 16
# (its exchange and routing key are empty); ``QUEUE_BIND``'s are nowait 1.
Plain = tuple[int, str, str, str, int]
QUEUE_DECLARE: Final = _QUEUE << 16 | _DECLARE
QUEUE_BIND: Final = _QUEUE << 16 | _BIND


def plain(record: bytes) -> Plain | None:
    """queue.declare / queue.bind without arguments, read field by field (boot replays one per
    durable queue and binding: no method object is built for them), or None (not one of those,
    or not exactly to its end: ``decode`` reads it)."""
    if len(record) < _HEAD.size + 6:
        return None
    ftype, _channel, size, cls, meth, _ticket = _HEAD.unpack_from(record)
    end = len(record) - 1
    if ftype != _FRAME_METHOD or cls != _QUEUE or size != end - 7 or record[end] != _FRAME_END:
        return None
    try:  # the short strings read inline: a boot reads two to four per record
        pos = _HEAD.size + 1 + record[_HEAD.size]
        queue = record[_HEAD.size + 1:pos].decode()
        if meth == _DECLARE:
            if pos > end or record[pos + 1:end] != _NO_ARGUMENTS:
                return None
            return QUEUE_DECLARE, queue, "", "", record[pos]
        if meth == _BIND:
            start = pos + 1
            pos = start + record[pos]
            exchange = record[start:pos].decode()
            start = pos + 1
            pos = start + record[pos]
            if pos > end or record[pos + 1:end] != _NO_ARGUMENTS:
                return None
            return QUEUE_BIND, queue, exchange, record[start:pos].decode(), record[pos]
    except (IndexError, UnicodeDecodeError):
        return None
    return None


def _plain_queue_record(record: bytes) -> PFrame | None:
    """``plain``'s reading as the pamqp object pamqp's ``unmarshal`` makes (defaults first, then
    the fields), or None (let pamqp read it)."""
    fields = plain(record)
    if fields is None:
        return None
    kind, queue, exchange, routing_key, bits = fields
    if kind == QUEUE_DECLARE:
        declare = commands.Queue.Declare()
        declare.queue = queue
        declare.passive = bool(bits & 1)
        declare.durable = bool(bits & 2)
        declare.exclusive = bool(bits & 4)
        declare.auto_delete = bool(bits & 8)
        declare.nowait = bool(bits & 16)
        return declare
    bind = commands.Queue.Bind()
    bind.queue = queue
    bind.exchange = exchange
    bind.routing_key = routing_key
    bind.nowait = bool(bits & 1)
    return bind
