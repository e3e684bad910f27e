"""The RabbitMQ Stream protocol's numbers: command keys, response codes, offset types.

One table for every side of the protocol: the server's codec (``broker/streamproto/codec.py``,
which re-exports these, so its users keep writing ``C.PUBLISH``) and the Spark sink's small
client (``broker/spark/stream_publish.py``), which the layer rules keep from importing the
server. Numbers only, no IO: the protocol's own numbering (a response is ``key | RESPONSE``),
and the one frame every side writes alike, a response (``response``: the cluster's carrier
answers a client's Open with it too, ``broker/cluster/stream_route.py``).
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = [
    "DECLARE_PUBLISHER",
    "PUBLISH",
    "PUBLISH_CONFIRM",
    "PUBLISH_ERROR",
    "QUERY_PUBLISHER_SEQUENCE",
    "DELETE_PUBLISHER",
    "SUBSCRIBE",
    "DELIVER",
    "CREDIT",
    "STORE_OFFSET",
    "QUERY_OFFSET",
    "UNSUBSCRIBE",
    "CREATE",
    "DELETE",
    "METADATA",
    "METADATA_UPDATE",
    "PEER_PROPERTIES",
    "SASL_HANDSHAKE",
    "SASL_AUTHENTICATE",
    "TUNE",
    "OPEN",
    "CLOSE",
    "HEARTBEAT",
    "ROUTE",
    "PARTITIONS",
    "CONSUMER_UPDATE",
    "EXCHANGE_COMMAND_VERSIONS",
    "CREATE_SUPER_STREAM",
    "DELETE_SUPER_STREAM",
    "RESPONSE",
    "OK",
    "STREAM_DOES_NOT_EXIST",
    "SUBSCRIPTION_ID_ALREADY_EXISTS",
    "SUBSCRIPTION_ID_DOES_NOT_EXIST",
    "STREAM_ALREADY_EXISTS",
    "STREAM_NOT_AVAILABLE",
    "SASL_MECHANISM_NOT_SUPPORTED",
    "AUTHENTICATION_FAILURE",
    "SASL_ERROR",
    "SASL_CHALLENGE",
    "AUTHENTICATION_FAILURE_LOOPBACK",
    "VHOST_ACCESS_FAILURE",
    "UNKNOWN_FRAME",
    "FRAME_TOO_LARGE",
    "INTERNAL_ERROR",
    "ACCESS_REFUSED",
    "PRECONDITION_FAILED",
    "PUBLISHER_DOES_NOT_EXIST",
    "NO_OFFSET",
    "OFFSET_FIRST",
    "OFFSET_LAST",
    "OFFSET_NEXT",
    "OFFSET_OFFSET",
    "OFFSET_TIMESTAMP",
]

# Command keys (the protocol's numbering).
DECLARE_PUBLISHER: Final = 1
PUBLISH: Final = 2
PUBLISH_CONFIRM: Final = 3
PUBLISH_ERROR: Final = 4
QUERY_PUBLISHER_SEQUENCE: Final = 5
DELETE_PUBLISHER: Final = 6
SUBSCRIBE: Final = 7
DELIVER: Final = 8
CREDIT: Final = 9
STORE_OFFSET: Final = 10
QUERY_OFFSET: Final = 11
UNSUBSCRIBE: Final = 12
CREATE: Final = 13
DELETE: Final = 14
METADATA: Final = 15
METADATA_UPDATE: Final = 16
PEER_PROPERTIES: Final = 17
SASL_HANDSHAKE: Final = 18
SASL_AUTHENTICATE: Final = 19
TUNE: Final = 20
OPEN: Final = 21
CLOSE: Final = 22
HEARTBEAT: Final = 23
ROUTE: Final = 24
PARTITIONS: Final = 25
CONSUMER_UPDATE: Final = 26
EXCHANGE_COMMAND_VERSIONS: Final = 27
CREATE_SUPER_STREAM: Final = 29
DELETE_SUPER_STREAM: Final = 30
RESPONSE: Final = 0x8000

# Response codes.
OK: Final = 1
STREAM_DOES_NOT_EXIST: Final = 2
SUBSCRIPTION_ID_ALREADY_EXISTS: Final = 3
SUBSCRIPTION_ID_DOES_NOT_EXIST: Final = 4
STREAM_ALREADY_EXISTS: Final = 5
STREAM_NOT_AVAILABLE: Final = 6
SASL_MECHANISM_NOT_SUPPORTED: Final = 7
AUTHENTICATION_FAILURE: Final = 8
SASL_ERROR: Final = 9
SASL_CHALLENGE: Final = 10
AUTHENTICATION_FAILURE_LOOPBACK: Final = 11
VHOST_ACCESS_FAILURE: Final = 12
UNKNOWN_FRAME: Final = 13
FRAME_TOO_LARGE: Final = 14
INTERNAL_ERROR: Final = 15
ACCESS_REFUSED: Final = 16
PRECONDITION_FAILED: Final = 17
PUBLISHER_DOES_NOT_EXIST: Final = 18
NO_OFFSET: Final = 19

# Offset specification types (Subscribe, ConsumerUpdate's answer).
OFFSET_FIRST: Final = 1
OFFSET_LAST: Final = 2
OFFSET_NEXT: Final = 3
OFFSET_OFFSET: Final = 4
OFFSET_TIMESTAMP: Final = 5


_HEAD: Final = struct.Struct(">IHH")  # a frame's size, key and version
_RESPONSE_HEAD: Final = struct.Struct(">IH")  # a response's correlation id and code


def frame(key: int, body: bytes, version: int = 1) -> bytes:
    """One frame: ``u32 size``, ``u16 key``, ``u16 version``, ``body``."""
    return _HEAD.pack(len(body) + 4, key, version) + body


def response(key: int, corr: int, code: int, extra: bytes = b"") -> bytes:
    """The response to request ``key`` with correlation id ``corr``: ``code`` and ``extra``."""
    return frame(key | RESPONSE, _RESPONSE_HEAD.pack(corr, code) + extra)
