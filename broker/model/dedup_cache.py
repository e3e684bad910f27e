"""A deduplicating exchange's cache: in memory, or on disk and on the followers.

Theory of operation
-------------------
An exchange declared with ``x-message-deduplication`` drops a message whose
``x-deduplication-header`` value it has seen within its cache: ``x-cache-size`` entries, the
oldest entry evicted first; an entry expires after ``x-cache-ttl`` ms (or the message's own
``x-cache-ttl`` header), and an expired key is remembered anew, as the newest, when it comes
again. Exactly once (the Spark sink's ``exactlyOnce`` to an exchange) rests on that: a task
retry publishes a batch whose first attempt was confirmed, and the exchange drops it. So the
cache must outlive the process that built it.

``x-cache-persistence`` (RabbitMQ's deduplication plugin's argument): ``memory`` keeps the
cache in this process only, as that plugin does by default; ``disk`` keeps it in a log of its
own. Skred's default is ``disk`` for a durable exchange (a transient one has nothing to come
back to: ``memory``), because a broker whose confirmed messages survive kill -9 and a leader's
loss must not let their retries through either (docs/compatibility.md lists the difference).

The log is a ``QueueStore`` under ``<vhost>/dedup/<sha1 of the exchange>``: one record per run
of keys taken as new together (a single publish, or a run or batch of them: ``write``), its
body the keys' entries column by column (their count, u32; their expiries in ms, i64, -1 for
none; their lengths, u32; the keys in UTF-8; little-endian). Everything a queue's store does
for messages it does for these records: appends go through the replication sink at once, so the
followers hold a key before the message it let through (the stream is ordered); the store is
the group commit's (``notify``), so a persistent message's confirm waits until its key is
fsynced and replicated with it; a full disk raises ``DiskFull`` before anything is written; a
torn last record is dropped at recovery. Every record is kept "taken", so it can be acked in
any order, and counts its keys still in the cache: a key evicted, expired and remembered anew,
or forgotten (its message was not stored) leaves its record, and a record left with none is
acked; a segment whose records are all acked is deleted. Eviction goes oldest first, so records
and segments go in order and the disk holds about ``x-cache-size`` keys' entries plus the write
segment. One record per run keeps the cost per key to building its entry (a record per key cost
several times the in-memory lookup).

The ordering rule: the keys ``seen`` took as new are written (``write``, called by the publish
operation) before their messages are stored; messages that then cannot be stored are forgotten
again (``forget``: their record acked, and the ack written at once). A duplicate dropped while
the original's key is not yet fsynced is confirmed after the next group commit (the publish
operation marks it ``sync``), so a confirmed duplicate never stands for an original a crash or
a failover could still lose.

Recovery (the exchange's declare at boot, or on a new leader) reads the records in order and
applies them as ``seen`` did: a later record of the same key replaces the earlier one, and the
oldest beyond ``x-cache-size`` are evicted. An expired entry stays until then, as it does while
the broker runs (it holds a place, so dropping it would bring back an evicted key), and the
cache is the one the broker had: acks a kill -9 lost within the sync window only bring back
records that are evicted again here. (A forgotten key's ack is written at once.) A store that
cannot be opened (corrupt) leaves the exchange routing with a memory cache, logged: the
exchange must not vanish with its cache.
"""

from __future__ import annotations

import logging
import struct
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from broker import errors, properties
from broker.errors import StoreError
from broker.store.queue_store import QueueStore

log = logging.getLogger(__name__)

DEDUP_HEADER = "x-deduplication-header"
PERSISTENCE = "x-cache-persistence"
_ABSENT: Any = object()
_COUNT = struct.Struct("<I")
_SWAP = sys.byteorder != "little"  # the arrays' native order against the log's little-endian
_NO_EXPIRY = -1


def _record(keys: list[str], expiries: list[int]) -> bytes:
    """A record's body: the count of entries, their expiries (ms, i64, -1 for none), their keys'
    lengths (u32), then the keys (UTF-8), each part built at once rather than entry by entry."""
    raw = [key.encode() for key in keys]
    exps, lens = array("q", expiries), array("I", map(len, raw))
    if _SWAP:
        exps.byteswap()
        lens.byteswap()
    return b"".join((_COUNT.pack(len(raw)), exps.tobytes(), lens.tobytes(), *raw))


def _entries_of(body: bytes) -> Iterator[tuple[str, int | None]]:
    """(key, expiry or None) of each entry of a record, in order."""
    n = _COUNT.unpack_from(body)[0]
    at = _COUNT.size
    expiries = array("q")
    expiries.frombytes(body[at:at + 8 * n])
    at += 8 * n
    lengths = array("I")
    lengths.frombytes(body[at:at + 4 * n])
    at += 4 * n
    if _SWAP:
        expiries.byteswap()
        lengths.byteswap()
    for exp, size in zip(expiries, lengths, strict=True):
        yield body[at:at + size].decode(errors="replace"), (None if exp == _NO_EXPIRY else exp)
        at += size


def now_ms() -> int:
    return int(time.time() * 1000)


def int_arg(value: Any) -> int | None:
    """An integer argument or header, as a number or its text; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        if text.strip().lstrip("-").isdigit():
            return int(text)
    return None


def key_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


class DedupCache:
    """The cache in memory (``x-cache-persistence: memory``)."""

    durable = False  # a dropped duplicate's confirm need not wait for a group commit

    def __init__(self, size: int, ttl: int | None) -> None:
        self.size = size
        self.ttl = ttl
        self.entries: OrderedDict[str, int | None] = OrderedDict()

    def seen(self, key: str, ttl: int | None, now: int | None = None) -> bool:
        """True for a duplicate; otherwise remembers ``key`` (``now``: the time in ms, if the
        caller has it)."""
        if now is None:
            now = now_ms()
        entries = self.entries
        exp = entries.get(key, _ABSENT)
        if exp is not _ABSENT:
            if exp is None or exp > now:
                return True
            entries.move_to_end(key)  # expired: remembered anew, as the newest
        ttl = ttl if ttl is not None else self.ttl
        entries[key] = now + ttl if ttl is not None else None
        if len(entries) > self.size:  # one key added at a time
            self._evicted(entries.popitem(last=False)[0])
        return False

    def _evicted(self, key: str) -> None:
        """The oldest key made room (the durable cache releases its record)."""

    def forget(self, props: list[bytes]) -> None:
        """The keys of messages ``seen`` took as new, which were then not stored (a full
        disk): their retries are new too. (What their arrival evicted stays evicted: the
        cache forgets, as its size bound does, and never drops a message it should keep.)"""
        for p in props:
            key = dedup_key(p)[0]
            if key is not None:
                self.entries.pop(key, None)

    def write(self) -> None:
        """Nothing to write: the durable cache writes what ``seen`` remembered."""

    def close(self, delete: bool = False) -> None:
        pass


class DurableDedupCache(DedupCache):
    """The cache with its log (``x-cache-persistence: disk``; module doc)."""

    durable = True

    def __init__(self, size: int, ttl: int | None, store: QueueStore) -> None:
        super().__init__(size, ttl)
        self.store = store
        self.ids: dict[str, int] = {}  # key -> the record that holds it
        self.live: dict[int, int] = {}  # record -> how many of its keys are still in the cache
        # what ``seen`` took as new and ``write`` has not written yet: the keys and their
        # entries, and the records whose last key went meanwhile (acked at the next write)
        self._pending: list[str] = []
        self._expiries: list[int] = []
        self._acks: list[int] = []
        self._dropped: list[str] = []  # pending keys that left the cache (see _release)
        self._recover()

    def _recover(self) -> None:
        store = self.store
        entries, ids, live = self.entries, self.ids, self.live
        while True:
            msgid = store.shift()
            if msgid is None:
                break
            live[msgid] = 0
            for key, exp in _entries_of(store.read(msgid)[4]):
                live[msgid] += 1  # first, so a key this record holds twice never empties it
                if key in entries:
                    entries.move_to_end(key)
                    self._release(key)
                entries[key] = exp
                ids[key] = msgid
                if len(entries) > self.size:
                    self._release(entries.popitem(last=False)[0])
            if not live[msgid]:
                del live[msgid]
                self._acks.append(msgid)
        if self._acks:
            store.ack_many(sorted(self._acks))
            self._acks = []
        if entries:
            log.info("deduplication cache %s: %d keys recovered", store.directory, len(entries))

    def _release(self, key: str) -> None:
        """``key`` leaves its record (evicted, replaced, forgotten): the record is acked with
        the next write once none of its keys is left. A key not written yet has no record."""
        msgid = self.ids.pop(key, None)
        if msgid is None:
            self._dropped.append(key)  # (its run's write counts it out if it is still gone)
            return
        left = self.live[msgid] - 1
        if left:
            self.live[msgid] = left
        else:
            del self.live[msgid]
            self._acks.append(msgid)

    def seen(self, key: str, ttl: int | None, now: int | None = None) -> bool:
        if DedupCache.seen(self, key, ttl, now):
            return True
        if key in self.ids:  # it had expired: it leaves its record, the key is the newest
            self._release(key)
        exp = self.entries[key]
        self._expiries.append(_NO_EXPIRY if exp is None else exp)
        self._pending.append(key)
        return False

    _evicted = _release

    def write(self) -> None:
        """The entries of the keys ``seen`` took as new since the last call, appended as one
        record, and the records left without a key acked. Called before their messages are
        stored; DiskFull (nothing written): those keys are not remembered either."""
        keys = self._pending
        if not keys:
            return
        body = _record(keys, self._expiries)
        acks = self._acks
        self._pending, self._expiries, self._acks = [], [], []
        store, entries = self.store, self.entries
        try:
            msgid = store.append_taken(now_ms(), b"", b"", b"", body)
        except BaseException:
            self._dropped = []
            for key in keys:
                entries.pop(key, None)
            if acks:
                store.ack_many(sorted(acks))
            raise
        mine = dict.fromkeys(keys, msgid)  # (a key twice in the run: once)
        if self._dropped:  # keys of this run that left the cache before it was written
            for key in self._dropped:
                if key not in entries:
                    mine.pop(key, None)
            self._dropped = []
        self.ids.update(mine)
        if mine:
            self.live[msgid] = len(mine)
        else:
            acks.append(msgid)
        if acks:
            store.ack_many(sorted(acks))

    def forget(self, props: list[bytes]) -> None:
        """As the memory cache's, and on disk: the publish operation forgets every key of a
        ``write`` (its single message, or the run's or batch's kept ones), so their record is
        left with no key and acked, and the ack written now. (A key forgotten alone, out of a
        record other keys still hold, would come back after a crash.)"""
        for p in props:
            key = dedup_key(p)[0]
            if key is not None and self.entries.pop(key, _ABSENT) is not _ABSENT:
                self._release(key)
        if self._acks:
            acks, self._acks = self._acks, []
            self.store.ack_many(sorted(acks))
            try:
                self.store.flush()  # the acks to their file now: a crash must not bring them back
            except OSError as exc:
                log.warning("deduplication cache %s: forgotten keys not written yet: %s",
                            self.store.directory, exc)

    def close(self, delete: bool = False) -> None:
        if delete:
            self.store.delete()
        else:
            self.store.close()


def dedup_cache(arguments: dict[str, Any], what: str, durable: bool,
                open_store: Any = None) -> DedupCache:
    """The cache an exchange's arguments ask for (406 on a bad one). ``open_store()`` makes
    its log's ``QueueStore``, for a durable exchange whose persistence is ``disk``."""
    size = int_arg(arguments.get("x-cache-size"))
    if size is None or size <= 0:
        raise errors.PreconditionFailed(
            f"invalid arg 'x-cache-size' for {what}: must be a positive integer", 40, 10)
    ttl_raw = arguments.get("x-cache-ttl")
    ttl = int_arg(ttl_raw) if ttl_raw is not None else None
    if ttl_raw is not None and (ttl is None or ttl <= 0):
        raise errors.PreconditionFailed(
            f"invalid arg 'x-cache-ttl' for {what}: must be a positive integer", 40, 10)
    kind = key_text(arguments.get(PERSISTENCE)) or ("disk" if durable else "memory")
    if kind not in ("memory", "disk"):
        raise errors.PreconditionFailed(
            f"invalid arg '{PERSISTENCE}' for {what}: must be 'memory' or 'disk'", 40, 10)
    if kind == "memory" or not durable or open_store is None:
        return DedupCache(size, ttl)
    try:
        store = open_store()
    except StoreError as exc:
        log.error("%s: its deduplication cache cannot be read (%s): kept in memory only", what, exc)
        return DedupCache(size, ttl)
    return DurableDedupCache(size, ttl, store)


_DEDUP_NAMES = (DEDUP_HEADER.encode(), b"x-cache-ttl")
# The headers table's first field when it is the key as a long string, in a list without a
# content type or encoding: flags (2), table size (4), then name size, name, type 'S' at 6.
_KEY_FIRST = bytes((len(DEDUP_HEADER),)) + DEDUP_HEADER.encode() + b"S"
_KEY_AT = 6 + len(_KEY_FIRST) + 4  # where its value starts
_TTL_FIELD = b"\x0bx-cache-ttl"
_HEADERS_ALONE = properties.HI_CONTENT_TYPE | properties.HI_CONTENT_ENCODING | properties.HI_HEADERS
_U32 = struct.Struct(">I").unpack_from


def dedup_key(props: bytes) -> tuple[str | None, int | None]:
    """A message's deduplication key and its own cache TTL (ms), from its two headers only.
    The common layout (the key the table's first field, no ``x-cache-ttl`` anywhere: what the
    Spark sink and most publishers send) is read where it lies, else the table is walked."""
    if props.startswith(_KEY_FIRST, 6) and props[0] & _HEADERS_ALONE == properties.HI_HEADERS \
            and _TTL_FIELD not in props:
        end = _KEY_AT + _U32(props, _KEY_AT - 4)[0]
        if end <= 6 + _U32(props, 2)[0]:  # within the table: its first field, so top-level
            return props[_KEY_AT:end].decode(errors="replace"), None
    value, ttl_value = properties.header_values(props, _DEDUP_NAMES)
    ttl = int_arg(ttl_value)
    return key_text(value), (ttl if ttl is not None and ttl > 0 else None)


def kept_by(cache: DedupCache, props: list[bytes]) -> list[int]:
    """The messages of a run that are not duplicates (indices), each looked up and remembered
    in order, as one by one, and written (``write``); ``forget`` undoes it for a run that then
    could not be stored."""
    kept = []
    seen = cache.seen
    now = now_ms()
    for i, p in enumerate(props):
        key, ttl = dedup_key(p)
        if key is None or not seen(key, ttl, now):
            kept.append(i)
    cache.write()
    return kept
