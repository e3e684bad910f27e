"""A stream's stored records, raw, over HTTP: the Spark source's network read.

Theory of operation
-------------------
``GET /api/streams/{vhost}/{queue}/records?offset=O&end=E&max_bytes=B&version=1`` answers the
stream's records from offset ``O`` (an integer, clamped to the retained range like
``x-stream-offset``, or ``first``/``last``/``next``; or ``timestamp=MS``: the first record
appended at or after it) as the bytes the store holds them in, one segment's consecutive
records back to back in the segment record format (``broker/store/segment.py``), so the
reader decodes them exactly as the data-dir read decodes segment files
(``broker/spark/segment_arrow.py``), column-wise, with no per-message framing on either side.
The answer stops before offset ``E`` (when given), at the end of a segment, and before the
record that would take the body past ``max_bytes`` (at most ``MAX_BYTES``), but always
carries one record when one is there; ``max_bytes=0`` answers no record, only the head,
which is how a reader asks for the extent or resolves a timestamp.

The body opens with a fixed head (``broker/recordwire.py``: magic, format version, the first
record's offset, the count, and the stream's retained range), then the records. The first
offset is above the offset asked when retention removed the ones between, which the reader
reports as data loss; the next request starts at first + count. A request naming another
format version (``version``) gets 400 before anything is read. The head rides in the body so
that a multi-worker node's fan-out (which relays only a few HTTP headers) and a follower's
proxy pass it on whole.

What is answered is what an AMQP stream consumer starting at ``O`` could be delivered now:
the store's records below its next offset (a record is visible only once complete).

Authorisation is AMQP's, not the management API's: any user that logs in (basic auth, the
same users and login throttle) may call it, with or without management tags, as any user may
consume a stream over AMQP; the vhost must be one the user may use and the user needs the
``read`` permission on the queue, as ``basic.consume`` does (``common.RECORD_ROUTES`` lets
the auth middleware skip the tag check for this route only). Bounds: one answer is at most
``MAX_BYTES`` of records (a single record larger than that is still answered whole: the
broker stored it, so it is within its message size limit), read synchronously from the
segment map in one slice, or a walk of at most 65,536 record lengths when the answer ends
inside a segment (``StreamStore.read_records``), so a request holds the event loop for about
one memory copy of that size plus at most some tens of milliseconds of walk. Across answers,
the bytes held at once are bounded by ``[mgmt] records_memory`` (a request waits at most
``records_wait`` seconds for its share, else 503 with Retry-After, before anything is read) and
each answer's life by ``records_send_timeout`` (a slower reader is cut off), see
``records_budget.py``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from aiohttp import web

from broker import recordwire
from broker.http.common import MGMT_KEY, RECORDS_PATH, bad_request, error_response
from broker.http.routes_streams import int_param, readable_stream, start_offset

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

MAX_BYTES: Final = 64 << 20  # record bytes per answer (ask again from first + count)
DEFAULT_BYTES: Final = 8 << 20


@routes.get(RECORDS_PATH)
async def stream_records(request: web.Request) -> web.StreamResponse:
    version = int_param(request, "version", recordwire.VERSION, 0, 1 << 31)
    if version != recordwire.VERSION:
        raise bad_request(f"records format version {version} is not served here (this broker "
                          f"serves version {recordwire.VERSION}): upgrade the client or the broker")
    _vhost, _name, q = readable_stream(request)
    max_bytes = int_param(request, "max_bytes", DEFAULT_BYTES, 0, MAX_BYTES)
    end = int_param(request, "end", 1 << 62, 0, 1 << 62)
    start = start_offset(request, q)
    bounds = request.app[MGMT_KEY].records
    held = min(max_bytes, bounds.budget.limit)
    if held and not await bounds.budget.take(held, bounds.wait):
        resp = error_response(503, "service_unavailable", "the records answers in flight hold this "
                              "node's records_memory: ask again later, or for fewer max_bytes")
        resp.headers["Retry-After"] = "1"
        return resp
    try:
        store = q.stream  # seek after the wait: retention may have moved the stream meanwhile
        pos = store.seek(start)
        first = pos.offset
        body = b""
        count = 0
        if held and first < end:
            got = store.read_records(pos, end - first, held)
            if got is not None:
                first, count, body = got
        held = bounds.budget.resize(held, len(body))
        head = recordwire.Head(first, count, store.first_offset, store.next_offset).pack()
        return await _send(request, head, body, bounds.send_timeout)
    finally:
        bounds.budget.give(held)


async def _send(request: web.Request, head: bytes, body: bytes, timeout: float) -> web.StreamResponse:
    """Send the answer within ``timeout`` seconds, or abort the connection (which drops what the
    transport still buffers, so the caller's budget is given back for memory really freed)."""
    resp = web.StreamResponse(headers={"Content-Type": recordwire.CONTENT_TYPE})
    resp.content_length = len(head) + len(body)
    try:
        async with asyncio.timeout(timeout):
            await resp.prepare(request)
            await resp.write(head)  # two writes: the records are not copied once more behind the head
            await resp.write(body)
            await resp.write_eof()
    except TimeoutError:
        log.info("records answer to %s not sent within %ss: connection cut off", request.remote, timeout)
        if request.transport is not None:
            request.transport.abort()
    except ConnectionError:  # the client went away: nothing more to send
        log.debug("records answer to %s: the client closed the connection", request.remote)
    return resp
