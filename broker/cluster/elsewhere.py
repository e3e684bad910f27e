"""AMQP on the cluster leader's own port, for a vhost another node serves (``shard_servers``).

Theory of operation
-------------------
A client never sees which node serves its vhost: a follower's proxy routes each AMQP connection
by the vhost its ``connection.open`` names (``vhost_route.py``), and the cluster leader's own
AMQP port must do the same, though there the broker itself reads the handshake. Its session
authenticates the client, checks the user may use the vhost, and on an ``open`` naming a vhost
this broker does not hold but the election says another node serves (``elsewhere``) hands the
connection over as it would to another worker (``broker.net.server``), with the client's
``start-ok`` (``replays_login``). ``hand_over`` rebuilds the client's handshake from it
(``Opened``: that start-ok, a ``tune-ok`` with the limits negotiated here, the ``open``, the
bytes read after it) and a proxy that reads no port of its own (``SpliceProxy.adopt``) replays
it on a tunnel to the serving node's replication port, which checks the login again, answers
``open-ok`` (or its refusal) and is spliced with the client. A serving node that cannot be
reached or does not answer within the handshake's bound gets the client a 320, as through a
follower. The credentials stay in memory only until the connection is carried.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from pamqp import commands, frame

from broker.cluster.proxy import SpliceProxy
from broker.cluster.vhost_route import Opened

log = logging.getLogger(__name__)


class Elsewhere:
    """``broker.amqp.broker.Shards`` for the cluster leader's broker: ``served_elsewhere(vhost)``
    says another node serves it; ``carrier`` (a routed, tunnelling ``SpliceProxy``) carries it."""

    replays_login = True

    def __init__(self, served_elsewhere: Callable[[str], bool], carrier: SpliceProxy) -> None:
        self.served_elsewhere = served_elsewhere
        self.carrier = carrier

    def elsewhere(self, vhost: str) -> bool:
        return self.served_elsewhere(vhost)

    def hand_over(self, fd: int, state: dict[str, Any]) -> None:
        login = bytes(state.get("login", b""))
        if not login:  # a connection with no start-ok to replay (never so for AMQP)
            raise ValueError("no login to replay on the vhost's node")
        vhost = str(state["vhost"])
        channel_max, frame_max = int(state["channel_max"]), int(state["frame_max"])
        tune_ok = commands.Connection.TuneOk(channel_max=channel_max, frame_max=frame_max,
                                             heartbeat=int(state["heartbeat"]))
        opened = Opened(vhost, login, frame.marshal(tune_ok, 0),
                        frame.marshal(commands.Connection.Open(virtual_host=vhost), 0),
                        bytes(state.get("rest", b"")), channel_max, frame_max)
        peer = state.get("peer")
        client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple | list) and len(peer) >= 2 \
            else ("127.0.0.1", 0)
        sock = socket.socket(fileno=os.dup(fd))
        sock.setblocking(False)
        log.debug("connection from %s:%d for vhost %r: carried to the node serving it", *client, vhost)
        self.carrier.adopt(sock, client, opened)
