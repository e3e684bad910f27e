"""The running broker's shared state, handed to every session.

Not a global: the node builds one ``Broker`` and passes it to the listener,
which passes it to each ``Session``. It holds the vhosts, users, the group
commit ``Syncer``, live connections, direct reply-to routes and counters.
"""

from __future__ import annotations

import logging
import platform
import time
from typing import TYPE_CHECKING, Any

from broker import __version__
from broker.auth.users import UserStore
from broker.config import Config
from broker.model.vhost import VHost
from broker.net.alarms import DiskAlarm
from broker.net.syncer import Syncer

if TYPE_CHECKING:
    from broker.net.session import ChannelState, Session


class Stats:
    """Plain integer counters: a publish costs one attribute increment."""

    __slots__ = ("published", "delivered", "acked", "confirmed", "unroutable", "connections_opened")

    def __init__(self) -> None:
        self.published = 0
        self.delivered = 0
        self.acked = 0
        self.confirmed = 0
        self.unroutable = 0
        self.connections_opened = 0


log = logging.getLogger("skred")


def client_name(properties: dict[str, Any]) -> str:
    """What a client calls itself: its connection_name, else its product (and version)."""
    name = properties.get("connection_name")
    if name:
        return str(name)
    product = properties.get("product")
    version = properties.get("version")
    return f"{product} {version}" if product and version else str(product or "")

class Broker:
    def __init__(self, config: Config, users: UserStore, vhosts: dict[str, VHost], syncer: Syncer) -> None:
        self.config = config
        self.users = users
        self.vhosts = vhosts
        self.syncer = syncer
        self.stats = Stats()
        self.connections: set[Session] = set()
        self.reply_to: dict[str, tuple[Session, ChannelState]] = {}
        # cluster members' addresses: they may send PROXY protocol headers
        self.trusted_peers: set[str] = set()
        # guest with full access everywhere is the common case: skip per-name checks then
        self.check_permissions = True
        # free_disk_min alarm: blocks publishers (broker/net/alarms.py; checked by the listener tick)
        self.alarm = DiskAlarm(config.main.data_dir, config.main.free_disk_min)
        self._server_properties: dict[str, Any] = {
            "product": "Skred",
            "version": __version__,
            "platform": f"Python {platform.python_version()}",
            "copyright": "Skred contributors",
            "information": "Disk-first AMQP 0-9-1 broker",
            "capabilities": {
                "publisher_confirms": True,
                "exchange_exchange_bindings": True,
                "basic.nack": True,
                "consumer_cancel_notify": True,
                "connection.blocked": True,
                "consumer_priorities": False,
                "authentication_failure_close": True,
                "per_consumer_qos": True,
                "direct_reply_to": True,
            },
        }

    def server_properties(self) -> dict[str, Any]:
        return self._server_properties

    def connection_opened(self, session: Session) -> None:
        self.connections.add(session)
        self.stats.connections_opened += 1
        vhost = session.vh.name if session.vh is not None else session.vhost  # set before the Open-Ok
        log.info("connection %s opened: user %r, vhost %r, client %r", session.name, session.username,
                 vhost, client_name(session.client_properties))
        log.debug("connection %s: client properties %r", session.name, session.client_properties)

    def connection_closed(self, session: Session) -> None:
        if session in self.connections:
            log.info("connection %s closed: user %r, vhost %r, client %r, open %.1f s", session.name,
                     session.username, session.vhost, client_name(session.client_properties),
                     time.time() - session.connected_at)
        self.connections.discard(session)
        self.alarm.forget(session)
