"""What a persistent MQTT session keeps beside its queues: QoS 2 state, shared subscriptions, a will.

Theory of operation
-------------------
A persistent session's plain subscriptions and QoS 1 messages are its durable queues and their
bindings (``session.py``). Three more things must outlive the connection, a restart, kill -9 and
a failover, and have no queue to live in:

- **QoS 2 packet identifiers received** (PUBREC sent, PUBREL not yet come). The client resends
  an unanswered PUBLISH with the same identifier after a reconnect; the identifier says "stored
  already", so the message is not stored twice. PUBREL forgets it.
- **Shared subscriptions** (``$share/group/filter``): the group's queue is shared, so the
  session's membership is not one of its own bindings. On a resumed session they are subscribed
  again (permissions checked again).
- **A persistent session's will**, from its CONNECT on (as mosquitto's persistence keeps the
  will with its client). While its client is connected it is kept "live" (``due`` 0, with its
  will delay): a node that dies with the client connected ended that connection abnormally, so
  a restart (or a new leader) arms it due its delay after the start. Once the connection ended
  abnormally it is kept with the wall-clock time it is due; a restart publishes it when due, or
  at once when overdue, unless the client came back first. DISCONNECT forgets it.

Each session with any of these is one small file in its vhost's own directory (``FilesOf``: the
node gives a ``store.blobs.BlobDir``, ``<sha1(vhost)>/mqtt-sessions``, so it moves, is replicated
and fails over with the vhost's shard, as retained messages do: ``retained.py``), named by a
digest of its vhost and client id, holding JSON. A change is written when it happens and reported
to the replication sink at once; the answer that depends on it (PUBREC, PUBCOMP) waits for the
group commit that fsyncs the file (and, in a cluster, for the in-sync followers of its shard), so
a state a client was told of survives kill -9 and failover. A session with nothing left to keep
has no file. An MQTT 5 session's file records when its session expiry ends once its client is
gone: after that it is forgotten (at the client's next CONNECT, or at the node's start). A vhost's
directory is read when the vhost opens here (at start, or when this node begins serving its shard:
``open``) and forgotten when it closes; a file that cannot be read is logged and skipped (that
session starts without it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from broker.mqtt import props as PR
from broker.mqtt.packets import Will
from broker.mqtt.retained import FilesOf

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (vhost, client id)


@dataclass
class PendingWill:
    """A persistent session's will: what to publish, as whom, and when (Unix time; 0: its
    connection is alive, due ``delay`` seconds after the connection, or the node, ends)."""

    will: Will
    username: str
    due: float
    delay: float = 0.0

    @property
    def live(self) -> bool:
        return self.due == 0.0


@dataclass
class SessionState:
    qos2: set[int] = field(default_factory=set)  # QoS 2 packet ids stored, awaiting PUBREL
    shared: dict[str, tuple[int, int]] = field(default_factory=dict)  # filter -> (options, sub id)
    will: PendingWill | None = None
    expires_at: float = 0.0  # Unix time its MQTT 5 session expiry ends (0: never, or connected)

    def expired(self, now: float) -> bool:
        return bool(self.expires_at) and now >= self.expires_at

    def empty(self) -> bool:
        return not self.qos2 and not self.shared and self.will is None


def _name(key: Key) -> str:
    return hashlib.sha256(key[0].encode() + b"\0" + key[1].encode()).hexdigest()[:40]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def encode(key: Key, s: SessionState) -> bytes:
    doc: dict[str, Any] = {"vhost": key[0], "client_id": key[1], "qos2": sorted(s.qos2),
                           "shared": {f: list(v) for f, v in s.shared.items()}, "expires_at": s.expires_at}
    if s.will is not None:
        w = s.will.will
        doc["will"] = {"topic": w.topic, "payload": _b64(w.message), "qos": w.qos, "retain": w.retain,
                       "props": _b64(PR.write(w.props)), "user": s.will.username, "due": s.will.due,
                       "delay": s.will.delay}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> tuple[Key, SessionState]:
    """Raises ValueError (or KeyError, TypeError) for a file this code did not write."""
    doc = json.loads(data)
    key = (str(doc["vhost"]), str(doc["client_id"]))
    state = SessionState({int(i) for i in doc["qos2"]},
                         {str(f): (int(v[0]), int(v[1])) for f, v in doc["shared"].items()},
                         expires_at=float(doc.get("expires_at", 0.0)))
    w = doc.get("will")
    if w is not None:
        props, _ = PR.read(base64.b64decode(w["props"]), 0, PR.WILL_PROPS)
        state.will = PendingWill(Will(str(w["topic"]), base64.b64decode(w["payload"]), int(w["qos"]),
                                      bool(w["retain"]), props), str(w["user"]), float(w["due"]),
                                  float(w.get("delay", 0.0)))
    return key, state


def vhost_of(data: bytes) -> str:
    """The vhost a session state's file names (``retained.adopt``)."""
    return str(json.loads(data)["vhost"])


class SessionStates:
    """Every persistent session's state of the vhosts open here, in memory and in their files."""

    def __init__(self, files_of: FilesOf) -> None:
        self.files_of = files_of
        self.by_key: dict[Key, SessionState] = {}
        self.opened: set[str] = set()

    def open(self, vhost: str) -> list[Key]:
        """Read the sessions of ``vhost`` from its files (once): the keys read."""
        if vhost in self.opened:
            return []
        self.opened.add(vhost)
        read = []
        for name, data in self.files_of(vhost).items():
            try:
                key, state = decode(data)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                log.warning("MQTT session state file %s unreadable (%s): skipped", name, exc)
                continue
            if key[0] == vhost:
                self.by_key[key] = state
                read.append(key)
        return read

    def close(self, vhost: str) -> None:
        """Forget the sessions of ``vhost`` (no longer served here; its files stay)."""
        self.opened.discard(vhost)
        for key in [k for k in self.by_key if k[0] == vhost]:
            del self.by_key[key]

    def get(self, key: Key) -> SessionState:
        """The session's state (a new, empty one, not yet kept, when it has none)."""
        return self.by_key.get(key) or SessionState()

    def save(self, key: Key, state: SessionState) -> None:
        """Keep ``state`` (or forget the session's state when it is empty). Raises OSError when
        the file cannot be written."""
        if state.empty():
            self.forget(key)
            return
        self.files_of(key[0]).put(_name(key), encode(key, state))
        self.by_key[key] = state

    def forget(self, key: Key) -> None:
        if self.by_key.pop(key, None) is not None:
            self.files_of(key[0]).delete(_name(key))
