"""Retained messages: the last retained PUBLISH per topic and vhost, on disk and replicated.

Theory of operation
-------------------
Each retained message is one small file (``Files``: the node gives a ``store.blobs.BlobDir`` in
the data dir), named by a digest of its vhost and topic and holding both, its QoS and payload. A
file is written when the message arrives, reported to the replication sink at once and fsynced by
the group commit that the publisher's PUBACK waits for, so a retained message a client saw
acknowledged survives kill -9 and is on every in-sync follower: after a failover the new leader
reads the directory and serves it (RabbitMQ keeps them node-local and loses them there). An empty
retained payload deletes the topic's file. At start the directory is read once into memory
(topic -> (QoS, payload) per vhost); a subscription is matched against it with
``topic_matches``, wildcard filters included, in time linear in the number of retained topics of
the vhost and the length of the filter: no pattern is compiled from client input.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Iterator
from typing import Protocol

log = logging.getLogger(__name__)

_U16 = struct.Struct(">H")


class Files(Protocol):
    def put(self, name: str, data: bytes) -> None: ...

    def delete(self, name: str) -> None: ...

    def items(self) -> Iterator[tuple[str, bytes]]: ...


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 3.1.1 section 4.7: ``+`` one level, ``#`` this level and all below; a topic starting
    with ``$`` is not matched by a wildcard in the first level."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    fl = topic_filter.split("/")
    tl = topic.split("/")
    for i, f in enumerate(fl):
        if f == "#":
            return True
        if i >= len(tl):
            return False
        if f != "+" and f != tl[i]:
            return False
    return len(fl) == len(tl)


def _name(vhost: str, topic: str) -> str:
    return hashlib.sha256(vhost.encode() + b"\0" + topic.encode()).hexdigest()[:40]


def _encode(vhost: str, topic: str, qos: int, payload: bytes) -> bytes:
    v, t = vhost.encode(), topic.encode()
    return _U16.pack(len(v)) + v + _U16.pack(len(t)) + t + bytes((qos,)) + payload


def _decode(data: bytes) -> tuple[str, str, int, bytes]:
    (n,) = _U16.unpack_from(data, 0)
    vhost = data[2:2 + n].decode()
    pos = 2 + n
    (m,) = _U16.unpack_from(data, pos)
    topic = data[pos + 2:pos + 2 + m].decode()
    pos += 2 + m
    qos = data[pos]
    if qos > 2:
        raise ValueError(f"QoS {qos}")
    return vhost, topic, qos, data[pos + 1:]


class Retained:
    def __init__(self, files: Files, max_messages: int) -> None:
        self.files = files
        self.max_messages = max_messages
        self.by_vhost: dict[str, dict[str, tuple[int, bytes]]] = {}
        self.count = 0
        for name, data in files.items():
            try:
                vhost, topic, qos, payload = _decode(data)
            except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
                log.warning("MQTT retained message file %s unreadable (%s): skipped", name, exc)
                continue
            self.by_vhost.setdefault(vhost, {})[topic] = (qos, payload)
            self.count += 1

    def set(self, vhost: str, topic: str, qos: int, payload: bytes) -> bool:
        """Keep (or, for an empty payload, clear) the topic's retained message; False when the
        node holds ``max_messages`` already. Raises OSError when the file cannot be written."""
        topics = self.by_vhost.setdefault(vhost, {})
        if not payload:
            if topic in topics:
                self.files.delete(_name(vhost, topic))
                del topics[topic]
                self.count -= 1
            return True
        if topic not in topics and self.count >= self.max_messages:
            return False
        self.files.put(_name(vhost, topic), _encode(vhost, topic, qos, payload))
        if topic not in topics:
            self.count += 1
        topics[topic] = (qos, payload)
        return True

    def matching(self, vhost: str, topic_filter: str) -> list[tuple[str, int, bytes]]:
        return [(t, qos, payload) for t, (qos, payload) in self.by_vhost.get(vhost, {}).items()
                if topic_matches(topic_filter, t)]
