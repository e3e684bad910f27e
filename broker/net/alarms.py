"""Periodic checks run from the listener's one-second tick: consumer timeouts and the disk alarm.

Theory of operation
-------------------
Consumer timeout: nothing is recorded per delivery. Each tick looks at every
channel's oldest unacked delivery (the first key of the insertion-ordered
``unacked`` dict) and remembers since when that same tag has been the oldest
(``ChannelState.head_tag/head_since``). Once that age passes the timeout (the
consumer's ``x-consumer-timeout`` argument, else the queue's, else the
``consumer-timeout`` key of the queue's policy or operator policy (the lower),
else ``[main] consumer_timeout``; 0 = off) the channel is closed with 406 "delivery
acknowledgement on channel N timed out", as RabbitMQ. A timeout fires at most
one tick late and never early.

Disk alarm: each tick compares the free space of the data dir's filesystem with
``[main] free_disk_min``. While it is below, every connection that publishes
stops being read: the read pause the listener already takes after each
publishing read batch is simply not lifted (``AMQPProtocol._resume_reading``
parks the protocol here). Clients that announced the ``connection.blocked``
capability get ``connection.blocked`` when the alarm goes on and
``connection.unblocked`` when it clears, after which parked connections are
read again. Consumers keep consuming and acking meanwhile, as in RabbitMQ.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import commands

from broker import errors
from broker.amqp.connection import State

if TYPE_CHECKING:
    from broker.net.session import Session

log = logging.getLogger(__name__)

BLOCK_REASON = "low on disk"


class Parked(Protocol):
    def unpark(self) -> None: ...


def _open(s: Session) -> bool:
    return bool(s.state == State.OPEN)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def check_consumer_timeouts(s: Session, now: float, default_ms: int) -> bool:
    """Close channels whose oldest delivery outlived its timeout; True when one was closed."""
    closed = False
    for chs in list(s.chs.values()):
        unacked = chs.unacked
        if not unacked:
            chs.head_tag = 0
            continue
        tag = next(iter(unacked))
        if tag != chs.head_tag:
            chs.head_tag = tag
            chs.head_since = now
            continue
        q, _msgid, c = unacked[tag]
        timeout = _int(c.arguments.get("x-consumer-timeout")) if c is not None else None
        if timeout is None:
            timeout = _int(q.arguments.get("x-consumer-timeout"))
        if timeout is None and s.vh is not None:
            timeout = _policy_timeout(s.vh.policy_set.for_queue(q.name))
        if timeout is None:
            timeout = default_ms
        if timeout > 0 and (now - chs.head_since) * 1000.0 >= timeout:
            # the session logs the close with its reply code and text
            s.close_channel(chs.id, errors.PreconditionFailed(
                f"delivery acknowledgement on channel {chs.id} timed out. Timeout value used: "
                f"{timeout} ms. This timeout value can be configured, see consumers doc guide to "
                "learn more"))
            closed = True
    return closed


def _policy_timeout(policies: tuple[Any, Any]) -> int | None:
    """The lower ``consumer-timeout`` of a (policy, operator policy) pair, if either sets one."""
    found = [t for p in policies if p is not None
             and (t := _int(p.definition.get("consumer-timeout"))) is not None]
    return min(found) if found else None


class DiskAlarm:
    def __init__(self, data_dir: Path, free_disk_min: int) -> None:
        self.data_dir = data_dir
        self.free_disk_min = free_disk_min
        self.active = False
        self.parked: set[Parked] = set()
        self.notified: set[Session] = set()

    def free(self) -> int:
        try:
            return shutil.disk_usage(self.data_dir).free
        except OSError:
            return 0

    def check(self, sessions: list[Session]) -> None:
        """One tick: raise or clear the alarm; tell clients that asked for it."""
        if not self.free_disk_min and not self.active:
            return
        # limit 0 turns the alarm off, which must also clear one in effect
        low = bool(self.free_disk_min) and self.free() < self.free_disk_min
        if low and not self.active:
            self.active = True
            log.warning("disk alarm: free space under %d bytes in %s; blocking publishers",
                        self.free_disk_min, self.data_dir)
        elif not low and self.active:
            self.active = False
            log.warning("disk alarm cleared; unblocking publishers")
            for s in self.notified:
                if _open(s):
                    s.send_method(0, commands.Connection.Unblocked())
                    s.wakeup()
            self.notified.clear()
            parked, self.parked = self.parked, set()
            for p in parked:
                p.unpark()
        if self.active:
            for s in sessions:
                if s not in self.notified and _open(s) and s.capabilities.get("connection.blocked"):
                    self.notified.add(s)
                    s.send_method(0, commands.Connection.Blocked(reason=BLOCK_REASON))
                    s.wakeup()

    def forget(self, s: Session) -> None:
        self.notified.discard(s)
