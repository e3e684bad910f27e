"""Exchange features: delayed messages, consistent hashing, message deduplication.

Theory of operation
-------------------
A plain exchange has ``special is None`` and pays one attribute test per
publish. An exchange of type ``x-delayed-message`` or ``x-consistent-hash``,
or one declared with ``x-message-deduplication``, gets an ``ExchangeSpecial``
(built when the vhost declares it; 406 on a bad argument), which the session asks first
(``on_publish``); it returns True when it consumed the message.

Routing types: ``routing_kind`` maps the declared type to the type the
exchange routes with: a delayed exchange routes as its ``x-delayed-type``
(direct, fanout, topic or headers) once the message is due.

Delayed messages (``x-delay`` header, ms, > 0) are appended to a store of their
own (a ``QueueStore`` under ``<vhost>/delayed/<sha1 of the exchange>``; durable
for a durable exchange, so they survive a restart), in arrival order. Every
stored message is kept "taken" (shifted) so it can be acked by id in any order.
Due times live in memory in a heap of (due ms, seq, msgid), rebuilt at boot by
reading each stored message once; one timer (the vhost's ``call_later``)
sleeps until the earliest due time, so nothing is scanned per tick. When due,
a message is routed with the underlying type (plus CC/BCC) and acked in the
delay store, and that ack is written to its file at once (not a sync window
later): a message routed before a kill -9 is not routed again at boot.

Consistent hashing (``x-consistent-hash``): the binding key is an integer
weight; each destination gets ``weight * POINTS_PER_WEIGHT`` points on a
64-bit ring (BLAKE2b of the destination name and point number), rebuilt only
when bindings change. A message goes to the first point at or after the hash
of its routing key, or of the header named by the ``hash-header`` argument, or
of the property named by ``hash-property`` (message_id, correlation_id,
timestamp), as RabbitMQ's plugin. Same key, same destination while the
bindings stay the same.

Super-stream hash routing (``x-super-stream-routing: hash`` on a super stream's exchange,
broker/model/superstream.py): a message goes to the partition at MurmurHash3 x86_32 (seed
104729, the stream clients' function) of its routing key modulo the partition count, the
partitions ordered by their bindings' ``x-stream-partition-order`` (rebuilt when bindings
change). Growing the partition count remaps keys, as it does for the stream clients.

Federation's upstream exchange (``x-federation-upstream``, declared on an upstream by a
downstream's exchange federation link, broker/federation/exchange_link.py, as RabbitMQ's
federation plugin declares it): routes as fanout to the link's queue, but only a message that
should cross the link: one that has crossed fewer than ``x-max-hops`` links (its
``x-received-from`` list) and never left the downstream named by ``x-downstream-name`` and
``x-downstream-vhost`` (it would go back where it came from). So hops are counted on the
upstream side and a message that would be dropped downstream never travels.

Deduplication (``x-message-deduplication`` on an exchange): a message whose
``x-deduplication-header`` value was seen within the cache (``x-cache-size``
entries, oldest evicted first; ``x-cache-ttl`` ms or the message's own ``x-cache-ttl``
header) is dropped before routing. The cache, in memory or (``x-cache-persistence:
disk``, a durable exchange's default) logged on disk and replicated, is
broker/model/dedup_cache.py's.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import logging
import shutil
from pathlib import Path
from typing import Any, Protocol

from broker import errors, properties
from broker.model.dedup_cache import DEDUP_HEADER as DEDUP_HEADER
from broker.model.dedup_cache import DedupCache as DedupCache
from broker.model.dedup_cache import dedup_cache, dedup_key, now_ms
from broker.model.dedup_cache import int_arg as _int_arg
from broker.model.dedup_cache import kept_by as kept_by
from broker.model.dedup_cache import key_text as _key_text
from broker.model.features import CallLater, TimerHandle
from broker.model.murmur3 import murmur3_32
from broker.model.publish_api import PublishRequest, Republisher
from broker.store.paths import queue_dir
from broker.store.queue_store import QueueStore
from broker.store.segment_log import SegmentFiles
from broker.store.sink import NULL_SINK, ReplicationSink

log = logging.getLogger(__name__)


class Owner(Protocol):
    """The exchange a behaviour belongs to (``broker.model.exchange.Exchange``, which sits
    above this module and holds its ``ExchangeSpecial``)."""

    @property
    def name(self) -> str: ...

    @property
    def type(self) -> str: ...

    @property
    def durable(self) -> bool: ...

    @property
    def arguments(self) -> dict[str, Any]: ...

    def bindings(self) -> list[tuple[object, str, dict[str, Any]]]: ...


class Host(Republisher, Protocol):
    """What an exchange's behaviour asks of its vhost (``VHost`` is one): where a delayed
    exchange keeps its messages, its timers and group commit, and the publish operation a
    message due goes through (``publish_from_hold``)."""

    @property
    def name(self) -> str: ...

    @property
    def dir(self) -> Path: ...

    @property
    def transient_dir(self) -> Path: ...

    @property
    def segment_size(self) -> int: ...

    @property
    def sink(self) -> ReplicationSink: ...

    @property
    def files(self) -> SegmentFiles: ...

    @property
    def call_later(self) -> CallLater | None: ...

    def mark_dirty(self, store: Any) -> None: ...

DELAYED = "x-delayed-message"
CONSISTENT_HASH = "x-consistent-hash"
FEDERATION_UPSTREAM = "x-federation-upstream"
EXTRA_TYPES = (DELAYED, CONSISTENT_HASH, FEDERATION_UPSTREAM)
BASE_TYPES = ("direct", "fanout", "topic", "headers")
POINTS_PER_WEIGHT = 64
DISK_RETRY_S = 1.0  # a due delayed message that found the disk full is routed again this much later
DEDUP = "x-message-deduplication"
PARTITION_ROUTING = "x-super-stream-routing"  # the same names as broker/model/superstream.py's
PARTITION_ORDER = "x-stream-partition-order"
_HASH_PROPERTIES = ("message_id", "correlation_id", "timestamp", "app_id", "type", "user_id",
                    "reply_to", "content_type", "priority", "delivery_mode")


def routing_kind(type_: str, arguments: dict[str, Any]) -> str:
    """The type an exchange routes with; 406 for a delayed exchange without a valid base type."""
    if type_ == FEDERATION_UPSTREAM:
        return "fanout"
    if type_ != DELAYED:
        return type_
    base = arguments.get("x-delayed-type")
    if isinstance(base, bytes):
        base = base.decode(errors="replace")
    if base not in BASE_TYPES:
        raise errors.PreconditionFailed(
            "Invalid argument, 'x-delayed-type' must be an existing exchange type", 40, 10)
    return str(base)


def needs_special(ex: Owner) -> bool:
    return ex.type in EXTRA_TYPES or bool(ex.arguments.get(DEDUP)) or PARTITION_ROUTING in ex.arguments


_headers = properties.headers


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


# ------------------------------------------------------------------ consistent hash
class HashRing:
    def __init__(self, bindings: list[tuple[object, str, dict[str, Any]]]) -> None:
        points: list[tuple[int, int]] = []
        self.dests: list[object] = []
        for dest, rk, _args in bindings:
            weight = _int_arg(rk)
            if weight is None or weight <= 0:
                weight = 1
            idx = len(self.dests)
            self.dests.append(dest)
            name = str(getattr(dest, "name", id(dest))).encode()
            for i in range(weight * POINTS_PER_WEIGHT):
                points.append((_h64(name + b"\x00" + str(i).encode()), idx))
        points.sort()
        self.keys = [p[0] for p in points]
        self.owner = [p[1] for p in points]

    def pick(self, key: str) -> object | None:
        if not self.keys:
            return None
        i = bisect.bisect_left(self.keys, _h64(key.encode()))
        if i == len(self.keys):
            i = 0
        return self.dests[self.owner[i]]


# ------------------------------------------------------------------ the special
class ExchangeSpecial:
    def __init__(self, vh: Host, ex: Owner) -> None:
        self.vh = vh
        self.ex = ex
        args = ex.arguments
        what = f"exchange '{ex.name}' in vhost '{vh.name}'"
        self.dedup = dedup_cache(args, what, ex.durable, lambda: QueueStore(
            self.dedup_dir(), segment_size=vh.segment_size, sink=vh.sink, files=vh.files,
            notify=vh.mark_dirty)) if args.get(DEDUP) else None
        self.hash_header = _key_text(args.get("hash-header")) if ex.type == CONSISTENT_HASH else None
        prop = _key_text(args.get("hash-property")) if ex.type == CONSISTENT_HASH else None
        if prop is not None and prop not in _HASH_PROPERTIES:
            raise errors.PreconditionFailed(f"unsupported hash-property '{prop}'", 40, 10)
        if prop is not None and self.hash_header is not None:
            raise errors.PreconditionFailed("hash-header and hash-property are mutually exclusive", 40, 10)
        self.hash_property = prop
        self._ring: HashRing | None = None
        self.delayed = DelayedStore(vh, ex) if ex.type == DELAYED else None
        routing = _key_text(args.get(PARTITION_ROUTING))
        if routing not in (None, "hash", "key"):
            raise errors.PreconditionFailed(f"invalid {PARTITION_ROUTING} '{routing}': 'hash' or 'key'",
                                            40, 10)
        self.partition_hash = routing == "hash"
        self._partitions: list[object] | None = None
        self.hop_filter = _hop_filter(args) if ex.type == FEDERATION_UPSTREAM else None

    def run_cache(self) -> DedupCache | None:
        """The deduplication cache, when deduplicating is all this exchange does of its own:
        the publish operation then takes a run through it at once (``publish_run``)."""
        if self.delayed is None and self.hop_filter is None and not self.partition_hash \
                and self.hash_property is None:
            return self.dedup
        return None

    # --------------------------------------------------------------- routing
    def bindings_changed(self) -> None:
        self._ring = None
        self._partitions = None

    def partitions(self) -> list[object]:
        """A super stream's partitions in ``x-stream-partition-order`` (hash routing)."""
        parts = self._partitions
        if parts is None:
            found = []
            for i, (dest, _key, args) in enumerate(self.ex.bindings()):
                order = args.get(PARTITION_ORDER)
                found.append((order if isinstance(order, int) else 1 << 30, i, dest))
            parts = self._partitions = [dest for _o, _i, dest in sorted(found, key=lambda t: t[:2])]
        return parts

    def ring(self) -> HashRing:
        ring = self._ring
        if ring is None:
            ring = self._ring = HashRing(self.ex.bindings())
        return ring

    def route_hash(self, routing_key: str, headers_of: Any) -> tuple[object, ...]:
        """Consistent-hash routing from ``Exchange.route`` (routing key or hash-header)."""
        key: str | None = routing_key
        if self.hash_header is not None:
            headers = headers_of() or {}
            key = _key_text(headers.get(self.hash_header))
            if key is None:
                return ()
        dest = self.ring().pick(key or "")
        return () if dest is None else (dest,)

    # --------------------------------------------------------------- publish
    def on_publish(self, ts: int, routing_key: str, props: bytes, body: bytes | memoryview,
                   persistent: bool) -> tuple[bool, list[object] | None]:
        """(kept, destinations): kept when dropped as a duplicate or held for a delay;
        destinations when this exchange picks them itself (hash-property), else None for
        routing by type. Called by the publish operation at every hop (broker/model/publish.py)."""
        headers: dict[str, Any] | None = None
        if self.hop_filter is not None and not self.hop_filter.forwards(_headers(props)):
            return False, []  # it stops here: routed nowhere
        if self.dedup is not None:
            key, ttl = dedup_key(props)
            if key is not None:
                if self.dedup.seen(key, ttl):
                    return True, None
                self.dedup.write()  # its record before the message (DiskFull: neither)
        if self.delayed is not None:
            if headers is None:
                headers = _headers(props)
            delay = _int_arg(headers.get("x-delay"))
            if delay is not None and delay > 0:
                self.delayed.add(ts, ts + delay, routing_key, props, bytes(body))
                return True, None
        if self.partition_hash:
            parts = self.partitions()
            return False, [parts[murmur3_32(routing_key.encode()) % len(parts)]] if parts else []
        if self.hash_property is not None:
            value = getattr(properties.decode(props), self.hash_property, None)
            if value is None:
                return False, []
            dest = self.ring().pick(_key_text(value) or "")
            return False, [] if dest is None else [dest]
        return False, None

    def dedup_dir(self) -> str:
        """Where a durable deduplication cache keeps its log (broker/model/dedup_cache.py)."""
        return str(queue_dir(self.vh.dir / "dedup", self.ex.name))

    def directories(self) -> list[str]:
        """The directories of this exchange's state on disk (held delayed messages, the
        deduplication cache's log): a boot's replay of a delete decides them at its end."""
        found = []
        if self.delayed is not None and self.delayed.durable:
            found.append(self.delayed.directory)
        if self.dedup is not None and self.dedup.durable:
            found.append(self.dedup_dir())
        return found

    def close(self, delete: bool = False) -> None:
        if self.delayed is not None:
            self.delayed.close(delete)
        if self.dedup is not None:
            self.dedup.close(delete)


class HopFilter:
    """What an ``x-federation-upstream`` exchange lets through (RabbitMQ's rule)."""

    __slots__ = ("max_hops", "downstream", "vhost")

    def __init__(self, max_hops: int, downstream: str | None, vhost: str | None) -> None:
        self.max_hops, self.downstream, self.vhost = max_hops, downstream, vhost

    def forwards(self, headers: dict[str, Any]) -> bool:
        hops = headers.get("x-received-from")
        if not isinstance(hops, list):
            return True
        if len(hops) >= self.max_hops:
            return False
        if self.downstream is None:
            return True
        for hop in hops:
            if isinstance(hop, dict) and _key_text(hop.get("cluster-name")) == self.downstream \
                    and _key_text(hop.get("vhost")) in (self.vhost, None):
                return False
        return True


def _hop_filter(args: dict[str, Any]) -> HopFilter:
    max_hops = _int_arg(args.get("x-max-hops"))
    if max_hops is None or max_hops < 1:
        raise errors.PreconditionFailed("x-federation-upstream: x-max-hops must be an integer of 1 or more",
                                        40, 10)
    return HopFilter(max_hops, _key_text(args.get("x-downstream-name")),
                     _key_text(args.get("x-downstream-vhost")))


# ------------------------------------------------------------------ delayed store
class DelayedStore:
    def __init__(self, vh: Host, ex: Owner) -> None:
        self.vh = vh
        self.ex = ex
        self.durable = ex.durable
        if ex.durable:
            directory = queue_dir(vh.dir / "delayed", ex.name)
            self.store = QueueStore(directory, segment_size=vh.segment_size, sink=vh.sink, files=vh.files)
        else:
            directory = queue_dir(vh.transient_dir / "delayed", ex.name)
            shutil.rmtree(directory, ignore_errors=True)
            self.store = QueueStore(directory, segment_size=vh.segment_size, sink=NULL_SINK, files=vh.files)
        self.directory = str(directory)  # where its messages are (a boot's replay buries it)
        self.heap: list[tuple[int, int, int]] = []
        self._seq = itertools.count()
        self._timer: TimerHandle | None = None
        self._timer_at = 0
        self._disk_wait = False  # due messages wait for disk space (logged once)
        self.closed = False
        self._rebuild()

    def _rebuild(self) -> None:
        """Boot: every stored message back into the heap by its due time (one read each)."""
        store = self.store
        while True:
            msgid = store.shift()
            if msgid is None:
                break
            ts, _ex, _rk, props, _body = store.read(msgid)
            try:
                delay = _int_arg(_headers(props).get("x-delay")) or 0
            except Exception:  # an unreadable header: deliver now rather than never
                delay = 0
            heapq.heappush(self.heap, (ts + max(delay, 0), next(self._seq), msgid))
        if self.heap:
            log.info("exchange %r: %d delayed messages recovered", self.ex.name, len(self.heap))
            self._arm()

    @property
    def count(self) -> int:
        return len(self.heap)

    def add(self, ts: int, due: int, routing_key: str, props: bytes, body: bytes) -> None:
        store = self.store
        store.append(ts, self.ex.name.encode(), routing_key.encode(), props, body)
        msgid = store.shift()  # keep every stored message taken: ack by id when due
        assert msgid is not None
        if self.durable:
            self.vh.mark_dirty(store)
        heapq.heappush(self.heap, (due, next(self._seq), msgid))
        self._arm()

    def _arm(self) -> None:
        call_later = self.vh.call_later
        if not self.heap or call_later is None or self.closed:
            return
        due = self.heap[0][0]
        if self._timer is not None:
            if self._timer_at <= due:
                return
            self._timer.cancel()
        self._timer_at = due
        self._timer = call_later(max(0.0, (due - now_ms()) / 1000.0) + 0.001, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.closed:
            return
        now = now_ms()
        heap = self.heap
        store = self.store
        budget = 4096  # per timer turn; the rest on the next (immediate) turn
        while heap and heap[0][0] <= now and budget:
            budget -= 1
            entry = heapq.heappop(heap)
            msgid = entry[2]
            try:
                _ts, _ex, rk, props, body = store.read(msgid)
                self.route(rk.decode(errors="replace"), props, body)
            except (errors.DiskFull, OSError) as exc:
                if not errors.no_space(exc):
                    log.exception("exchange %r: routing a delayed message failed", self.ex.name)
                else:
                    # Not stored anywhere (a message is stored in all its queues or none):
                    # it stays held, and this one and those due after it are tried again.
                    heapq.heappush(heap, entry)
                    if not self._disk_wait:
                        self._disk_wait = True
                        log.warning("exchange %r: disk full, due delayed messages wait (retried "
                                    "every %.0f s)", self.ex.name, DISK_RETRY_S)
                    self._retry_later()
                    break
            except Exception:  # one bad message must not stall the rest
                log.exception("exchange %r: routing a delayed message failed", self.ex.name)
            store.ack(msgid)
            if self.durable:
                # Routed means settled here, on disk (and on the replicas) now rather than a
                # sync window later: a kill -9 in that window would route it again at boot,
                # and in a cluster the restarted leader would do so before any follower
                # could merge its copy of this ack.
                store.flush()
            self._disk_wait = False
        else:
            self._arm()
        if self.durable:
            self.vh.mark_dirty(store)

    def _retry_later(self) -> None:
        call_later = self.vh.call_later
        if call_later is not None:
            self._timer_at = now_ms() + int(DISK_RETRY_S * 1000)
            self._timer = call_later(DISK_RETRY_S, self._fire)

    def route(self, routing_key: str, props: bytes, body: bytes) -> None:
        """A due message: published again from this exchange, which now routes it by its
        underlying type (its delay is not applied again; exchanges after it apply theirs)."""
        if self.vh.exchanges.get(self.ex.name) is not self.ex:
            return
        self.vh.publish_from_hold(PublishRequest(self.ex.name, routing_key, props, body, now_ms()))

    def close(self, delete: bool = False) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if delete:
            self.store.delete()
        else:
            self.store.close()
