"""The head of a raw records answer (``GET /api/streams/{vhost}/{queue}/records``).

Shared by the broker's route (``broker/http/routes_stream_records.py``) and the Spark source's
reader (``broker/spark/netread.py``), which the layer rules keep apart. The answer's body is
this fixed head, then ``count`` records in the segment record format
(``broker/store/segment.py``). The head rides in the body, not in HTTP headers, so whatever
relays the answer (a multi-worker node's fan-out, a follower's proxy) relays it whole, and a
reader meeting another format version fails on the magic and version before reading a record.
"""

from __future__ import annotations

import struct
from typing import Final

MAGIC: Final = b"SKRR"
VERSION: Final = 1  # the records follow segment.py's record format, version 1
# magic, version, reserved, first offset, count, stream's first offset, stream's next offset
HEAD: Final = struct.Struct("<4sHHQQQQ")
CONTENT_TYPE: Final = "application/vnd.skred.records"


class Head:
    """What an answer's head says: its records' first offset and count, and the stream's
    retained range when it was answered."""

    __slots__ = ("first", "count", "stream_first", "stream_next")

    def __init__(self, first: int, count: int, stream_first: int, stream_next: int) -> None:
        self.first, self.count = first, count
        self.stream_first, self.stream_next = stream_first, stream_next

    @property
    def next(self) -> int:
        return self.first + self.count

    def pack(self) -> bytes:
        return HEAD.pack(MAGIC, VERSION, 0, self.first, self.count, self.stream_first, self.stream_next)


def unpack(data: bytes) -> Head:
    """The head at the start of ``data``; ValueError when it is not one of this version."""
    if len(data) < HEAD.size:
        raise ValueError(f"a records answer of {len(data)} bytes has no head")
    magic, version, _reserved, first, count, s_first, s_next = HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a records answer (bad magic)")
    if version != VERSION:
        raise ValueError(f"records format version {version}; this reader decodes version {VERSION}: "
                         "upgrade the client or the broker")
    return Head(first, count, s_first, s_next)
