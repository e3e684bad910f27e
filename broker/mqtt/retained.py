"""Retained messages: the last retained PUBLISH per topic and vhost, on disk and replicated.

Theory of operation
-------------------
Each retained message is one small file in its vhost's own directory (``FilesOf``: the node gives
a ``store.blobs.BlobDir`` inside the vhost's directory, ``<sha1(vhost)>/mqtt-retained``), named by
a digest of its vhost and topic and holding both, its QoS and payload. The state of a vhost lives
with the vhost's shard: it moves with it between workers, is replicated to the shard's in-sync
replicas by whichever node serves it and fails over with it (a node-wide directory belonged to the
cluster leader's replication and lost what a shard's server wrote there). A file is written when
the message arrives, reported to the replication sink at once and fsynced by the group commit
that the publisher's PUBACK waits for, so a retained message a client saw acknowledged survives
kill -9 and is on every in-sync follower of its shard: after a failover the shard's new server
reads the directory and serves it (RabbitMQ keeps them node-local and loses them there). An
empty retained payload deletes the topic's file. A vhost's directory is read into memory (topic ->
(QoS, payload)) when the vhost is first used here (``open``: at start, or when this node begins
serving its shard) and forgotten when it stops being served here (``close``); files of a data
dir from before, in the node-wide ``mqtt-retained``, are moved into their vhosts' directories at
start (``adopt``). A subscription is matched against it with
``topic_matches``, wildcard filters included, in time linear in the number of retained topics of
the vhost and the length of the filter: no pattern is compiled from client input.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable, Iterator
from typing import Protocol

log = logging.getLogger(__name__)

_U16 = struct.Struct(">H")


class Files(Protocol):
    def put(self, name: str, data: bytes) -> None: ...

    def delete(self, name: str) -> None: ...

    def items(self) -> Iterator[tuple[str, bytes]]: ...


FilesOf = Callable[[str], Files]  # a vhost's own files (in its shard's directory)


def adopt(legacy: Files, files_of: FilesOf, here: Callable[[str], bool],
          vhost_of: Callable[[bytes], str], durable: Callable[[], None]) -> int:
    """Move each file of a node-wide directory from before (``legacy``) whose vhost is ``here``
    into that vhost's own files: all written there and made ``durable`` before any is deleted
    here (a crash in between leaves both copies, and the next start moves them again); how many
    moved. A file that cannot be read stays (logged by its reader later, or never read again)."""
    moved = []
    for name, data in list(legacy.items()):
        try:
            vhost = vhost_of(data)
        except (ValueError, KeyError, TypeError, IndexError, struct.error, UnicodeDecodeError):
            continue
        if here(vhost):
            files_of(vhost).put(name, data)
            moved.append(name)
    if moved:
        durable()
    for name in moved:
        legacy.delete(name)
    return len(moved)


def vhost_of(data: bytes) -> str:
    """The vhost a retained message's file names (``adopt``)."""
    return _decode(data)[0]


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
    def __init__(self, files_of: FilesOf, max_messages: int) -> None:
        self.files_of = files_of
        self.max_messages = max_messages
        self.by_vhost: dict[str, dict[str, tuple[int, bytes]]] = {}
        self.count = 0  # of the vhosts read here (every vhost served here once started)

    def open(self, vhost: str) -> dict[str, tuple[int, bytes]]:
        """The retained messages of ``vhost``, read from its files the first time."""
        topics = self.by_vhost.get(vhost)
        if topics is not None:
            return topics
        topics = self.by_vhost[vhost] = {}
        for name, data in self.files_of(vhost).items():
            try:
                owner, topic, qos, payload = _decode(data)
            except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
                log.warning("MQTT retained message file %s unreadable (%s): skipped", name, exc)
                continue
            if owner == vhost:
                topics[topic] = (qos, payload)
        self.count += len(topics)
        return topics

    def close(self, vhost: str) -> None:
        """Forget ``vhost`` (no longer served here; its files stay, read again at ``open``)."""
        self.count -= len(self.by_vhost.pop(vhost, {}))

    def set(self, vhost: str, topic: str, qos: int, payload: bytes) -> bool:
        """Keep (or, for an empty payload, clear) the topic's retained message; False when the
        node holds ``max_messages`` already. Raises OSError when the file cannot be written."""
        topics = self.open(vhost)
        if not payload:
            if topic in topics:
                self.files_of(vhost).delete(_name(vhost, topic))
                del topics[topic]
                self.count -= 1
            return True
        if topic not in topics and self.count >= self.max_messages:
            return False
        self.files_of(vhost).put(_name(vhost, topic), _encode(vhost, topic, qos, payload))
        if topic not in topics:
            self.count += 1
        topics[topic] = (qos, payload)
        return True

    def matching(self, vhost: str, topic_filter: str) -> list[tuple[str, int, bytes]]:
        return [(t, qos, payload) for t, (qos, payload) in self.open(vhost).items()
                if topic_matches(topic_filter, t)]
