"""The receive hot path: count deliveries and confirms in a byte stream, build no objects.

Theory of operation: :meth:`FrameScanner.scan` walks complete frames in ``buf[start:end]`` with
one precompiled ``unpack_from`` per frame (type and size), checks the 0xCE end octet, and
returns the offset of the first incomplete frame; the caller keeps those bytes and appends the
next ``recv_into`` after them. It never slices or copies the buffer and never decodes message
properties:

* a content header sets ``remaining`` to the body size it announces (a message with an empty
  body completes at once); body frames subtract their size; a message counts as consumed only
  when ``remaining`` reaches exactly zero, so a broker that drops or truncates body bytes shows
  up as a lower count (or a :class:`CodecError`), never as a higher one;
* basic.deliver increments ``delivered`` and, when acking, records its delivery tag;
* basic.ack / basic.nack from the broker (publisher confirms) settle tags in :class:`Confirms`;
* any other method frame is queued in ``other`` as ``(channel, class, method, payload)`` for the
  slow path (handshake replies, channel.close, basic.cancel ...);
* with latency tracking on, the first 8 body bytes of each message are the sender's
  ``time.monotonic_ns()`` (system-wide on Linux); ``now - sent`` goes into a fixed histogram
  (see ``stats.py`` for the bucket formula, inlined here).
"""

from __future__ import annotations

import struct

from broker.perf.codec import CodecError
from broker.perf.stats import new_histogram

_HEAD = struct.Struct(">BxxI")  # frame type, (channel), payload size
_CM = struct.Struct(">HH")
_U64 = struct.Struct(">Q")
_U16 = struct.Struct(">H")
_ACK_BITS = struct.Struct(">QB")


class Confirms:
    """Publisher-confirm bookkeeping: every tag up to ``upto`` is settled, plus ``singles``."""

    __slots__ = ("upto", "singles", "acked", "nacked")

    def __init__(self) -> None:
        self.upto = 0
        self.singles: set[int] = set()
        self.acked = 0
        self.nacked = 0

    @property
    def settled(self) -> int:
        return self.acked + self.nacked

    def settle(self, tag: int, multiple: bool, nack: bool) -> None:
        upto = self.upto
        if tag <= upto:
            return
        if multiple:
            singles = self.singles
            if singles:
                below = {t for t in singles if t <= tag}
                self.singles = singles - below
                count = tag - upto - len(below)
            else:
                count = tag - upto
            self.upto = tag
        else:
            if tag in self.singles:
                return
            count = 1
            if tag == upto + 1:
                upto = tag
                singles = self.singles
                while upto + 1 in singles:
                    upto += 1
                    singles.discard(upto)
                self.upto = upto
            else:
                self.singles.add(tag)
        if nack:
            self.nacked += count
        else:
            self.acked += count


class FrameScanner:
    """Incremental counter of complete deliveries, confirms and other method frames."""

    __slots__ = (
        "completed",
        "delivered",
        "body_bytes",
        "last_tag",
        "track_tags",
        "confirms",
        "other",
        "latency",
        "_remaining",
        "_size",
    )

    def __init__(self, *, track_tags: bool = False, track_latency: bool = False) -> None:
        self.completed = 0
        self.delivered = 0
        self.body_bytes = 0
        self.last_tag = 0
        self.track_tags = track_tags
        self.confirms = Confirms()
        self.other: list[tuple[int, int, int, bytes]] = []
        self.latency: list[int] | None = new_histogram() if track_latency else None
        self._remaining = 0  # body bytes still owed by the current message
        self._size = 0  # body size of the current message

    def scan(self, buf: bytearray | bytes | memoryview, start: int, end: int, now_ns: int = 0) -> int:
        """Consume every complete frame in ``buf[start:end]``; return where the rest begins."""
        head = _HEAD.unpack_from
        cm = _CM.unpack_from
        u64 = _U64.unpack_from
        remaining = self._remaining
        size_now = self._size
        completed = self.completed
        delivered = self.delivered
        body_bytes = self.body_bytes
        track_tags = self.track_tags
        hist = self.latency
        pos = start
        try:
            while end - pos >= 8:
                ftype, size = head(buf, pos)
                fend = pos + 7 + size
                if fend >= end:
                    break
                if buf[fend] != 0xCE:
                    raise CodecError(f"frame end octet missing at offset {fend}")
                if ftype == 3:
                    if remaining <= 0:
                        raise CodecError("body frame without a content header")
                    if hist is not None and remaining == size_now and size >= 8:
                        us = (now_ns - u64(buf, pos + 7)[0]) // 1000
                        if us < 32:
                            hist[us if us > 0 else 0] += 1
                        else:
                            s = us.bit_length() - 5
                            hist[(s << 4) + (us >> s)] += 1
                    remaining -= size
                    body_bytes += size
                    if remaining == 0:
                        completed += 1
                    elif remaining < 0:
                        raise CodecError("body frames exceed the announced body size")
                elif ftype == 1:
                    cls, meth = cm(buf, pos + 7)
                    if cls == 60 and meth == 60:
                        delivered += 1
                        if track_tags:
                            self.last_tag = u64(buf, pos + 12 + buf[pos + 11])[0]
                    elif cls == 60 and (meth == 80 or meth == 120):
                        tag, flags = _ACK_BITS.unpack_from(buf, pos + 11)
                        self.confirms.settle(tag, bool(flags & 1), meth == 120)
                    else:
                        channel = _U16.unpack_from(buf, pos + 1)[0]
                        self.other.append((channel, cls, meth, bytes(buf[pos + 11 : fend])))
                elif ftype == 2:
                    if remaining > 0:
                        raise CodecError("content header before the previous body completed")
                    size_now = remaining = u64(buf, pos + 11)[0]
                    if remaining == 0:
                        completed += 1
                elif ftype != 8:  # heartbeats are ignored (we negotiate them off)
                    raise CodecError(f"unknown frame type {ftype}")
                pos = fend + 1
        finally:
            self._remaining = remaining
            self._size = size_now
            self.completed = completed
            self.delivered = delivered
            self.body_bytes = body_bytes
        return pos
