"""Reading a stream over the network as raw segment records (``option("uri", "http://...")``).

Theory of operation
-------------------
The broker answers ``GET /api/streams/{vhost}/{queue}/records`` on its management HTTP port
(``broker/http/routes_stream_records.py``) with the stored bytes of a run of consecutive
records, in the segment record format, plus the run's first offset, count and next offset in
headers. Those bytes are what the data-dir read finds in a segment file, so a task decodes
them with the same column-wise code (``segment_arrow.walk`` and ``columns``): the network
read costs the broker one memory copy per answer and the task what a data-dir read costs,
with no per-message frame on either side (the AMQP consume path decoded a deliver, a header
and a body frame per row in Python).

An answer's body is a fixed head (``broker/recordwire.py``: the records' first offset and count,
the stream's retained range) and then the records. A read of ``[start, stop)`` asks from
``start`` with ``end=stop`` and pages with the answer's first + count until it reaches
``stop`` or the stream's end; each request is bounded by ``max_bytes`` (the broker caps it
too). An answer whose first offset is above the one asked means retention removed the records
between: ``gap`` is called with the missing range (the source raises its DataLoss there unless
``failOnDataLoss=false``). The extent and timestamp lookups are the same request with
``max_bytes=0`` (a head, no record).

The connection is one keep-alive HTTP/1.1 connection per task (``http.client``; a request that
meets a connection the broker closed while idle is sent once more on a new one), with basic
auth from the URI's user and password (``guest:guest`` when absent, as AMQP URIs default),
and ``timeout`` seconds per socket operation. ``https://`` is TLS to the management TLS port
(15671 by default: name it in the URI), the server's certificate verified against the system's trust
store or the URI's ``cafile``/``capath``, a client certificate from ``certfile``/``keyfile``
(the query options of an ``amqps://`` URI, ``broker/links/wire.py``; ``no_verify_ssl=1`` turns
verification off); the query is not part of the request path. The request names the body format version; the
broker refuses another with 400 and the answer's head must carry the same magic and version,
so a client and a broker that disagree fail with a clear error instead of misreading bytes. A 503
with Retry-After (the broker's records memory budget is busy) is asked again after that pause
until ``timeout`` seconds have passed; anything else but 200, or a 503 past that time, raises
``RecordsError`` with the broker's reason (401: login or the read permission refused).
"""

from __future__ import annotations

import base64
import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Final

from broker import recordwire
from broker.links.wire import ssl_context
from broker.spark.segment_arrow import SegmentColumns, columns, walk

DEFAULT_MAX_BYTES: Final = 8 << 20  # record bytes per request
SCHEMES: Final = ("http", "https")


class RecordsError(RuntimeError):
    """The broker refused a records request (status and reason in the message)."""


def is_records_uri(uri: str | None) -> bool:
    return bool(uri) and urllib.parse.urlsplit(uri or "").scheme.lower() in SCHEMES


class Answer(recordwire.Head):
    """One records answer: its head and the whole body (the records start at ``HEAD.size``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        head = recordwire.unpack(data)
        super().__init__(head.first, head.count, head.stream_first, head.stream_next)
        self.data = data


class RecordsClient:
    """One keep-alive connection to a broker's management port, for one vhost."""

    def __init__(self, uri: str, vhost: str, timeout: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme.lower() not in SCHEMES or not parts.hostname:
            raise ValueError(f"skred: '{uri}' is not an http(s)://user:password@host:port URI")
        user = urllib.parse.unquote(parts.username or "guest")
        password = urllib.parse.unquote(parts.password or "guest")
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        if parts.scheme.lower() == "https":
            options = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query).items()}
            self._conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=timeout, context=ssl_context(options))
        else:
            self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self._base = parts.path.rstrip("/")
        self._timeout = timeout
        self.vhost = vhost

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> RecordsClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def get(self, queue: str, max_bytes: int, end: int | None = None, **start: int | str) -> Answer:
        """One request; ``start`` is ``offset=`` (an integer or first/last/next) or ``timestamp=``."""
        q = urllib.parse.quote
        query = {"version": recordwire.VERSION, "max_bytes": max_bytes, **start}
        if end is not None:
            query["end"] = end
        path = (f"{self._base}/api/streams/{q(self.vhost, safe='')}/{q(queue, safe='')}/records?"
                + urllib.parse.urlencode(query))
        deadline = time.monotonic() + self._timeout
        while True:
            status, retry_after, data = self._send(queue, path)
            if status != 503 or retry_after is None or time.monotonic() + retry_after > deadline:
                break
            time.sleep(retry_after)  # the broker's records budget is busy: ask again, within timeout
        if status != 200:
            raise RecordsError(f"skred: stream '{queue}' in vhost '{self.vhost}': HTTP {status}: "
                               f"{_reason(data)}")
        try:
            return Answer(data)
        except ValueError as exc:
            raise RecordsError(f"skred: stream '{queue}': {exc}") from None

    def _send(self, queue: str, path: str) -> tuple[int, float | None, bytes]:
        """(status, Retry-After seconds capped at 5 when given, body) of one GET."""
        for attempt in range(2):
            try:
                self._conn.request("GET", path, headers={"Authorization": self._auth})
                resp = self._conn.getresponse()
                data = resp.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                self._conn.close()  # a fresh connection for the next request
                # the broker closes a keep-alive connection left idle (Spark not pulling):
                # a GET is safe to send again once, on a new connection
                stale = isinstance(exc, (ConnectionResetError, BrokenPipeError))  # RemoteDisconnected too
                if attempt or not stale:
                    raise ConnectionError(f"skred: stream '{queue}': {exc}") from exc
        after = resp.getheader("Retry-After")
        try:
            retry_after = min(max(float(after), 0.05), 5.0) if after is not None else None
        except ValueError:
            retry_after = None
        return resp.status, retry_after, data

    def extent(self, queue: str) -> tuple[int, int]:
        """(first offset, next offset) of the stream now."""
        a = self.get(queue, 0, offset="first")
        return a.stream_first, a.stream_next

    def first_at(self, queue: str, ts: int) -> int:
        """The first offset appended at or after ``ts`` (the next offset if none is)."""
        return self.get(queue, 0, timestamp=ts).first

    def records(self, queue: str, start: int, stop: int, max_bytes: int,
                gap: Callable[[int, int], None]) -> Iterator[Answer]:
        """Answers covering the records with offsets in ``[start, stop)``, in order."""
        at = start
        while at < stop:
            a = self.get(queue, max_bytes, end=stop, offset=at)
            if a.first > at:
                gap(at, min(a.first, stop))
            if not a.count:
                return  # the stream ends before ``stop`` (or retention took the rest)
            yield a
            at = a.next


def _reason(data: bytes) -> str:
    try:
        return str(json.loads(data)["reason"])
    except (ValueError, KeyError, TypeError):
        return data[:200].decode("utf-8", "replace")


def read_columns(client: RecordsClient, queue: str, start: int, stop: int, batch_rows: int,
                 max_bytes: int, ts_lo: int | None, ts_hi: int | None,
                 gap: Callable[[int, int], None]) -> Iterator[SegmentColumns]:
    """Column batches of the records with offsets in ``[start, stop)`` appended within
    ``[ts_lo, ts_hi]``, at most ``batch_rows`` rows each (batch boundaries carry no meaning)."""
    for a in client.records(queue, start, stop, max_bytes, gap):
        size, pos, offset, done = len(a.data), recordwire.HEAD.size, a.first, False
        while not done:
            at, stamps, pos, offset, done = walk(a.data, size, pos, offset, start, stop, batch_rows, size)
            if len(at):
                seg = columns(a.data, at, stamps, offset - len(at), ts_lo, ts_hi)
                if len(seg):
                    yield seg
