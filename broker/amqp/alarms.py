"""Periodic checks run from the listener's one-second tick: consumer timeouts and the
resource alarms (disk, memory).

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

Resource alarms: while any is in effect, every connection that publishes stops
being read: the read pause the listener already takes after each publishing read
batch is simply not lifted (``AMQPProtocol._resume_reading`` parks the protocol
here). Clients that announced the ``connection.blocked`` capability get
``connection.blocked`` (reason "low on disk" / "low on memory") when the first
alarm goes on and ``connection.unblocked`` when the last clears, after which
parked connections are read again. Consumers keep consuming and acking
meanwhile, as in RabbitMQ.

Disk: the free space of the data dir's filesystem against ``[main]
free_disk_min``, checked each tick and also as soon as an eighth of that margin
has been read from clients, so a burst of large publishes cannot run through it
between two ticks. A write that still finds no space (the store's ``DiskFull``)
raises the alarm at once and latches it until the failed write would fit above
the threshold; the session nacks (or refuses) the publish, never closing the
connection. Memory: see broker/amqp/memory.py.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import commands

from broker import errors
from broker.amqp.connection import State
from broker.amqp.memory import MemoryAlarm

if TYPE_CHECKING:
    from broker.amqp.session import Session

log = logging.getLogger(__name__)


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
    """Free space under ``data_dir`` against ``free_disk_min``, plus the latch a failed write sets."""

    def __init__(self, data_dir: Path, free_disk_min: int) -> None:
        self.data_dir = data_dir
        self.free_disk_min = free_disk_min
        self.active = False
        # A write that found no space holds the alarm until that many bytes fit above the threshold.
        self.latched_need = 0
        # bytes read from clients since the last check, and how many call for an early one
        # (``Alarms.note_read``)
        self.read_since_check = 0
        self.next_check = self.check_every()

    def free(self) -> int:
        try:
            return shutil.disk_usage(self.data_dir).free
        except OSError:
            return 0

    def evaluate(self) -> bool:
        """Whether the alarm should be in effect now."""
        if not self.free_disk_min and not self.latched_need:
            return False  # limit 0 turns the alarm off, which must also clear one in effect
        free = self.free()
        if self.latched_need and free >= self.free_disk_min + self.latched_need:
            self.latched_need = 0
        return free < self.free_disk_min or bool(self.latched_need)

    def check_every(self) -> int:
        """Bytes read between two eager checks: an eighth of the margin, at least 1 MiB."""
        return max(1 << 20, self.free_disk_min >> 3)


class Alarms:
    """The resource alarms (disk, memory) and the one blocked/unblocked state they drive."""

    def __init__(self, disk: DiskAlarm, memory: MemoryAlarm) -> None:
        self.disk = disk
        self.memory = memory
        self.parked: set[Parked] = set()
        self.notified: set[Session] = set()
        self.active = False  # any alarm in effect: publishers are not read

    def resources(self) -> list[str]:
        """The alarms in effect, by RabbitMQ's resource names."""
        return [name for name, a in (("disk", self.disk), ("memory", self.memory)) if a.active]

    def check(self, sessions: Iterable[Session]) -> None:
        """One tick: re-evaluate every alarm, then block or unblock clients."""
        self._check_disk()
        self.memory_changed(sessions)

    def _check_disk(self) -> None:
        self.disk.read_since_check = 0
        self.disk.next_check = self.disk.check_every()
        disk = self.disk.evaluate()
        if disk != self.disk.active:
            self.disk.active = disk
            if disk:
                log.warning("disk alarm: free space under %d bytes in %s; blocking publishers",
                            self.disk.free_disk_min + self.disk.latched_need, self.disk.data_dir)
            else:
                log.warning("disk alarm cleared")

    def memory_changed(self, sessions: Iterable[Session]) -> None:
        """Measure memory again (a body completed, a connection waits or went away)."""
        mem = self.memory
        active = mem.evaluate()
        if active != mem.active:
            mem.active = active
            if active:
                log.warning("memory alarm: %d bytes used (watermark %d)%s; blocking publishers", mem.used,
                            mem.limit, f", {len(mem.waiting)} connection(s) waiting" if mem.waiting else "")
            else:
                log.warning("memory alarm cleared (%d bytes used, watermark %d)", mem.used, mem.limit)
        self._apply(sessions)

    def note_read(self, sessions: Iterable[Session]) -> None:
        """``disk.next_check`` bytes were read from clients since the last check: check the
        disk early, so a burst of large publishes cannot run through the margin between two
        ticks."""
        if self.disk.free_disk_min:
            self._check_disk()
            self._apply(sessions)
        else:
            self.disk.read_since_check = 0

    def disk_full(self, need: int, sessions: Iterable[Session]) -> None:
        """A write of ``need`` bytes found no space: alarm now, whatever the threshold says."""
        self.disk.latched_need = max(self.disk.latched_need, need, 1)
        if not self.disk.active:
            self.disk.active = True
            log.warning("disk full: a write of %d bytes found no space in %s; blocking publishers",
                        need, self.disk.data_dir)
        self._apply(sessions)

    def _apply(self, sessions: Iterable[Session]) -> None:
        active = self.disk.active or self.memory.active
        if active and not self.active:
            self.active = True
        elif not active and self.active:
            self.active = False
            log.warning("resource alarms cleared; unblocking publishers")
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
                    s.send_method(0, commands.Connection.Blocked(reason=f"low on {self.resources()[0]}"))
                    s.wakeup()

    def forget(self, s: Session) -> None:
        self.notified.discard(s)
