"""The memory high watermark: RabbitMQ's ``vm_memory_high_watermark`` and an admission gate
for message bodies being assembled.

Theory of operation
-------------------
What the broker holds in memory is anonymous memory: segments are files, mapped or written,
and live in the page cache. So "memory used" is the process's anonymous resident set
(``/proc/self/statm``: resident minus file-backed pages), and the watermark is
``vm_memory_high_watermark_absolute`` bytes, or else ``vm_memory_high_watermark`` times total
memory (the smaller of RAM and the cgroup's limit), as RabbitMQ computes it.

Above the watermark the alarm is on: like the disk alarm, every publisher is sent
``connection.blocked`` and is not read until it clears (broker/amqp/alarms.py).

Measuring once a second is not enough for large messages: ten connections that each begin
a 100 MiB body at once hold a gigabyte before the next measurement. So every body being
assembled is admitted first. A connection whose content headers announce more body bytes
than it already holds asks the gate; the gate admits the bytes if memory used at the last
measurement plus everything admitted plus the request stays under the watermark, or if
nothing else is admitted (one body at a time always goes through, so the gate never
deadlocks: admitted connections are always read until their bodies are complete). A
connection that is not admitted is not read (and the alarm is on) until earlier bodies are
complete and memory is measured again; waiting connections are admitted in arrival order.

Freed memory only counts once the allocator gives it back, so while the alarm is on each
measurement first asks glibc to return free heap pages (``malloc_trim``).

The same trim gives memory back after a peak (issue 31: 1,000 queues with a producer and a
consumer connection each, used and deleted, left a worker at 125 MiB of anonymous memory
against 37 MiB idle, of which ``malloc_trim`` returned 66 MiB). The node keeps freed
buffers on the heap on purpose (``node.keep_buffers_on_the_heap``: a fresh page per socket
read cost a third of the CPU), so glibc never trims on its own below that threshold, and a
heap fragmented by many connections' buffers keeps its free pages for good. So a
measurement outside the alarm also trims when the allocator's free bytes (glibc's
``mallinfo2``: ``fordblks``) grew by ``TRIM_OVER`` since the last trim, at most once per
``TRIM_EVERY`` seconds: a busy broker pays at most one round of page faults for its working
set per ``TRIM_EVERY`` (about 8,000 faults for 32 MiB, milliseconds), an idle one returns to
its idle size within seconds. Free bytes, not resident size, decide: a trim at the top of a
peak returns nothing, and measured by resident size it made the peak the new reference, so
the frees that followed (queues deleted, connections closed) were never trimmed (issue 31:
124 MiB twelve seconds after 1,000 queues were deleted, against 35 MiB idle and 58 MiB after
a trim). A trim does not lower ``fordblks``
for the pages it returns from inside free chunks, so growth counts from the value right
after the last trim. Where ``mallinfo2`` is missing, growth of resident size decides.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _libc(name: str) -> Any:
    """The C library's function ``name``, or None where it is missing (not glibc, too old)."""
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None


def _libc_trim() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)`` (give free heap pages back to the OS), or a no-op."""
    trim = _libc("malloc_trim")
    if trim is None:
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


release_free_memory = _libc_trim()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _libc_free_bytes() -> Callable[[], int | None]:
    """glibc's free bytes held by malloc (``mallinfo2().fordblks``), or None where missing."""
    info = _libc("mallinfo2")
    if info is None:
        return lambda: None
    info.argtypes = []
    info.restype = _MallInfo2
    return lambda: int(info().fordblks)


heap_free_bytes = _libc_free_bytes()


def anon_memory() -> int:
    """Anonymous resident bytes of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            fields = fh.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def total_memory() -> int:
    """RAM, or the cgroup's memory limit if that is smaller."""
    total = 0
    try:
        total = os.sysconf("SC_PHYS_PAGES") * _PAGE
    except (ValueError, OSError, AttributeError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            total = min(total, int(text)) if total else int(text)
    return total


def watermark(relative: float, absolute: int) -> int:
    """The limit in bytes: ``absolute`` if set, else ``relative`` of total memory; 0 = off."""
    if absolute:
        return absolute
    return int(relative * total_memory())


class Waiter(Protocol):
    def admitted(self, total: int) -> None:
        """The gate admitted this connection's bodies (``total`` bytes): read it again."""


TRIM_OVER = 8 << 20  # anonymous memory grown this much since the last trim: trim again
TRIM_EVERY = 10.0  # seconds: at most one trim per this outside the alarm


class MemoryAlarm:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.active = False
        self.used = anon_memory() if limit else 0  # at the last measurement
        self.admitted = 0  # body bytes admitted and not yet complete, all connections
        self.waiting: dict[Waiter, tuple[int, int]] = {}  # arrival order: (held, wanted)
        self._clock = clock
        self._trimmed_to = self.used  # anonymous memory right after the last trim
        self._free_after_trim = heap_free_bytes()  # the allocator's free bytes then (None: unknown)
        self._trimmed_at = clock()

    def measure(self) -> None:
        """Anonymous memory now; freed heap pages given back first while the alarm is on, and
        after growth since the last trim (see the module doc)."""
        used = anon_memory()
        now = self._clock()
        if self.active or (now - self._trimmed_at >= TRIM_EVERY and self._grown(used) >= TRIM_OVER):
            release_free_memory()
            used = anon_memory()
            self._trimmed_to, self._trimmed_at = used, now
            self._free_after_trim = heap_free_bytes()
        self._trimmed_to = min(self._trimmed_to, used)  # shrank by itself: growth counts from here
        self.used = used

    def _grown(self, used: int) -> int:
        """Bytes a trim could give back that were not there at the last one: the allocator's
        free bytes grown since, or (without ``mallinfo2``) anonymous memory grown since."""
        if self._free_after_trim is None:
            return used - self._trimmed_to
        free = heap_free_bytes()
        if free is None:
            return used - self._trimmed_to
        self._free_after_trim = min(self._free_after_trim, free)  # reused: growth counts from here
        return free - self._free_after_trim

    def evaluate(self) -> bool:
        """Whether the alarm should be in effect now (measures first)."""
        if not self.limit:
            return False
        self.measure()
        self._admit_waiting()
        return self.used >= self.limit or bool(self.waiting)

    def request(self, who: Waiter, held: int, wanted: int) -> bool:
        """``who`` holds ``held`` admitted bytes and now needs ``wanted`` in all. True: it holds
        ``wanted`` now; False: it waits (do not read it) until ``who.admitted`` is called."""
        if wanted <= held:
            self.waiting.pop(who, None)
            self.admitted -= held - wanted
            return True
        if self.waiting or not self._fits(held, wanted):
            # behind whoever waits already (the caller measures again, which may admit it now)
            self.waiting[who] = (held, wanted)
            return False
        self.admitted += wanted - held
        return True

    def release(self, who: Waiter, held: int) -> None:
        """``who`` is gone (connection closed): give back what it held or waited for."""
        self.waiting.pop(who, None)
        self.admitted -= held

    def _fits(self, held: int, wanted: int) -> bool:
        others = self.admitted - held
        return others <= 0 or self.used + self.admitted + (wanted - held) <= self.limit

    def _admit_waiting(self) -> None:
        while self.waiting:
            who, (held, wanted) = next(iter(self.waiting.items()))
            if not self._fits(held, wanted):
                return
            del self.waiting[who]
            self.admitted += wanted - held
            who.admitted(wanted)
